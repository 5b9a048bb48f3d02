"""EK-FAC eigenvalue correction: empirical second moments in a fixed Kronecker eigenbasis.

``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` (elementwise) with ``Q_G``, ``Q_A`` the eigenvectors of a
K-FAC fit (George et al., 2018; Grosse et al., 2023). The conventions (matrix form, token
counting, distributed all-reduce) are those of :mod:`dattri_llm.gradient.ops.kronecker`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.ops.kronecker import (
    KroneckerFactors,
    LayerEigen,
    _acc_dtype,
    _as_gradient,
    _check_same_layers,
    _check_shape,
    _progress,
    _ref,
    _rotated,
)
from dattri_llm.utils.distributed import all_reduce_sum, get_world_size, is_distributed

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

    def update(self, gradient: Gradient) -> None:
        """Add one block of training gradients."""
        for name, eig in self.factors.layers.items():
            if name not in gradient.layers:
                raise ValueError(
                    f"layer {name!r} of the fit is missing from a training block "
                    f"(layers: {gradient.layer_names})."
                )
            lg = gradient.layers[name]
            _check_shape(name, lg, eig)
            ref = _ref(lg)
            ct = _acc_dtype(ref)
            q_g = eig.q_g.to(device=ref.device, dtype=ct)
            q_a = eig.q_a.to(device=ref.device, dtype=ct)
            acc = self.sums.get(name)
            if acc is None:
                acc = self.sums[name] = torch.zeros(
                    q_g.shape[0],
                    q_a.shape[0],
                    device=ref.device,
                    dtype=torch.promote_types(eig.s_a.dtype, ct),
                )
            for rot in _rotated(lg, q_g, q_a, ct):
                acc += rot.pow(2).sum(0).to(acc.dtype)
            self.counts[name] = self.counts.get(name, 0.0) + lg.batch_size

    def result(self) -> KroneckerFactors:
        """All-reduce over ranks and return the ``"ekfac"`` fit (sharing the eigenvectors)."""
        sums, counts = self.sums, self.counts
        if is_distributed() and get_world_size() > 1:
            _check_same_layers(sorted(sums), next(iter(sums.values())).device if sums else None)
            for name in sorted(sums):
                all_reduce_sum(sums[name])
                n = all_reduce_sum(
                    torch.tensor([counts[name]], dtype=torch.float64, device=sums[name].device)
                )
                counts[name] = float(n[0])
        layers = {}
        for name, eig in self.factors.layers.items():
            if name not in sums or counts[name] <= 0:
                raise ValueError(
                    f"no training gradient reached layer {name!r}: EK-FAC needs a "
                    "pass over the training gradients."
                )
            layers[name] = LayerEigen(
                eig.layer_type,
                eig.module_kwargs,
                eig.q_a,
                eig.s_a,
                eig.q_g,
                eig.s_g,
                sums[name] / counts[name],
                counts[name],
            )
        f = self.factors
        return KroneckerFactors("ekfac", layers, dict(f.diagonal), dict(f.skipped))


def fit_eigenvalue_correction(
    factors: KroneckerFactors,
    gradients: Iterable,
    progress: bool = False,
) -> KroneckerFactors:
    """EK-FAC: :class:`EigenvalueCorrection` over one pass on the training gradients.

    Args:
        factors: A K-FAC fit (its eigenbasis is kept).
        gradients: The training gradients (Gradients or GradientBlocks); all-reduced over ranks.
        progress: Show a progress bar.

    Returns:
        A new ``"ekfac"`` fit sharing the eigenvectors.
    """
    corr = EigenvalueCorrection(factors)
    for item in _progress(gradients, "EK-FAC eigenvalues", progress):
        corr.update(_as_gradient(item))
    return corr.result()
