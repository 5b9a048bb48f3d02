"""EK-FAC: the eigenvalue correction of a K-FAC fit, in its fixed eigenbasis.

EK-FAC replaces the K-FAC eigenvalues ``s_G s_A^T`` with empirical second moments in the same
basis: ``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` (elementwise) with ``Q_G``, ``Q_A`` the eigenvectors
of a K-FAC fit (George et al., 2018; Grosse et al., 2023). The conventions (matrix form, token
counting, distributed all-reduce) are those of :mod:`dattri_llm.gradient.kronecker`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.kronecker.covariances import (
    as_gradient,
    check_same_layers,
    fit_progress,
    sum_counts,
)
from dattri_llm.gradient.kronecker.factors import KroneckerFactors, in_basis, rotated
from dattri_llm.gradient.layers import get_rule
from dattri_llm.utils.distributed import all_reduce_sum, get_world_size

__all__ = ["EigenvalueCorrection", "fit_eigenvalue_correction"]


class EigenvalueCorrection:
    """Incremental EK-FAC eigenvalues: ``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` in a fixed basis.

    Args:
        factors: A K-FAC fit (its eigenbasis is kept).
    """

    def __init__(self, factors: KroneckerFactors) -> None:
        self.factors = factors
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, float] = {}
        # a vector layer's basis is its exact Fisher's: its eigenvalues are already exact
        self.exact = {n for n, e in factors.layers.items() if get_rule(e.layer_type).exact_fisher}

    @property
    def needs_pass(self) -> bool:
        """Whether any layer needs the pass over the training gradients (vector layers do not)."""
        return len(self.exact) < len(self.factors.layers)

    def update(self, gradient: Gradient) -> None:
        """Add one block of training gradients."""
        for name, eig in self.factors.layers.items():
            if name in self.exact:
                continue
            if name not in gradient.layers:
                raise ValueError(
                    f"layer {name!r} of the fit is missing from a training block "
                    f"(layers: {gradient.layer_names})."
                )
            lg = gradient.layers[name]
            ref, ct, q_g, q_a = in_basis(name, lg, eig)
            acc = self.sums.get(name)
            if acc is None:
                acc = self.sums[name] = torch.zeros(
                    eig.eigenvalues().shape,
                    device=ref.device,
                    dtype=torch.promote_types(eig.s_a.dtype, ct),
                )
            for rot in rotated(lg, q_g, q_a, ct):
                acc += rot.pow(2).sum(0).to(acc.dtype)
            self.counts[name] = self.counts.get(name, 0.0) + lg.batch_size

    def result(self) -> KroneckerFactors:
        """All-reduce over ranks and return the ``"ekfac"`` fit (sharing the eigenvectors)."""
        sums, counts = self.sums, self.counts
        if get_world_size() > 1:
            check_same_layers(sorted(sums), next(iter(sums.values())).device if sums else None)
            for name in sorted(sums):
                all_reduce_sum(sums[name])
                (counts[name],) = sum_counts(sums[name].device, counts[name])
        layers = {}
        for name, eig in self.factors.layers.items():
            if name in self.exact:
                layers[name] = replace(eig, corrected=eig.eigenvalues())
                continue
            if name not in sums or counts[name] <= 0:
                raise ValueError(
                    f"no training gradient reached layer {name!r}: EK-FAC needs a "
                    "pass over the training gradients."
                )
            layers[name] = replace(
                eig, corrected=sums[name] / counts[name], num_samples=counts[name]
            )
        f = self.factors
        return KroneckerFactors("ekfac", layers, dict(f.diagonal), dict(f.skipped))


def fit_eigenvalue_correction(
    factors: KroneckerFactors,
    gradients: Iterable,
    progress: bool | None = False,
) -> KroneckerFactors:
    """EK-FAC: :class:`EigenvalueCorrection` over one pass on the training gradients.

    Args:
        factors: A K-FAC fit (its eigenbasis is kept).
        gradients: The training gradients (Gradients or GradientBlocks); all-reduced over ranks.
        progress: Show a progress bar (``None``: only on a terminal).

    Returns:
        A new ``"ekfac"`` fit sharing the eigenvectors.
    """
    corr = EigenvalueCorrection(factors)
    for item in fit_progress(gradients, "EK-FAC eigenvalues", progress):
        corr.update(as_gradient(item))
    return corr.result()
