"""Fitting Kronecker curvature: the K-FAC eigenbasis and the EK-FAC eigenvalue correction.

:func:`eigendecompose` gives the K-FAC fit (eigenvectors and eigenvalues of ``A`` and ``G``).
EK-FAC replaces the eigenvalues with empirical second moments in that fixed basis:

``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` (elementwise) with ``Q_G``, ``Q_A`` the eigenvectors of a
K-FAC fit (George et al., 2018; Grosse et al., 2023). The conventions (matrix form, token
counting, distributed all-reduce) are those of :mod:`dattri_llm.gradient.ops.kronecker`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import replace

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.ops.kronecker import (
    KroneckerCovariances,
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
from dattri_llm.utils.distributed import (
    all_reduce_sum,
    get_rank,
    get_world_size,
    is_distributed,
)

__all__ = ["eigendecompose", "EigenvalueCorrection", "fit_eigenvalue_correction"]


def eigendecompose(
    covariances: KroneckerCovariances,
    dtype: torch.dtype = torch.float64,
    progress: bool | None = False,
    warn_skipped: bool = True,
) -> KroneckerFactors:
    """K-FAC fit: eigendecompose every layer's ``A`` and ``G`` (batched over equal sizes).

    All-reduces the covariances first under ``torch.distributed`` and broadcasts rank 0's
    eigenvectors, so every rank holds the same basis.

    Args:
        covariances: Accumulated sums.
        dtype: Eigendecomposition dtype (float64 by default even for float32 models).
        progress: Show a progress bar (``None``: only on a terminal).
        warn_skipped: Warn once, listing the layers left out.
    """
    covariances.all_reduce()
    if not covariances.layers and not covariances.diagonal:
        raise ValueError(
            "no Kronecker-eligible layer was seen: nothing to fit. Hook linear / "
            "convolution layers (linear_io) for K-FAC, or capture with a 'dense' / 'sparse' / "
            "'mask' projection (fitted with its exact Fisher) or a 'logra' one."
        )
    mats: dict[tuple[str, str], torch.Tensor] = {}
    for name, c in covariances.layers.items():
        if c.num_samples <= 0 or c.num_tokens <= 0:
            raise ValueError(f"layer {name!r} has no samples or no tokens carrying gradient.")
        mats[(name, "a")] = c.a_mean().to(dtype)
        mats[(name, "g")] = (c.g_sum / c.num_samples).to(dtype)
    eig: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    groups: dict[tuple[int, torch.device], list[tuple[str, str]]] = {}
    for key, m in mats.items():
        groups.setdefault((m.shape[-1], m.device), []).append(key)
    for (n, _), keys in _progress(list(groups.items()), "eigendecomposition", progress):
        # a blocked layer (fused experts) adds its E matrices to the batch
        stacked = torch.cat([(0.5 * (mats[k] + mats[k].mT)).reshape(-1, n, n) for k in keys])
        s, q = torch.linalg.eigh(stacked)
        start = 0
        for key in keys:
            lead = mats[key].shape[:-2]
            stop = start + math.prod(lead)
            eig[key] = (
                s[start:stop].reshape(*lead, n).clamp_min(0),
                q[start:stop].reshape(*lead, n, n).contiguous(),
            )
            start = stop
    if is_distributed() and get_world_size() > 1:
        for key in sorted(eig):
            for t in eig[key]:
                torch.distributed.broadcast(t, src=0)
    layers = {
        name: LayerEigen(
            c.layer_type,
            c.module_kwargs,
            eig[(name, "a")][1],
            eig[(name, "a")][0],
            eig[(name, "g")][1],
            eig[(name, "g")][0],
            None,
            c.num_samples,
        )
        for name, c in covariances.layers.items()
    }
    skipped = dict(covariances.skipped)
    if skipped and warn_skipped and get_rank() == 0:
        warnings.warn(
            "K-FAC/EK-FAC applies to linear, convolution and fused-expert layers and projected "
            "vectors only; "
            "these layers are left "
            f"out of the preconditioner and of the scores: {skipped}. Pass "
            "non_kronecker='diagonal' (to the attributor, and to the "
            "KroneckerCovarianceCallback whose covariances it fits) to precondition them with a "
            "diagonal Fisher instead, or exclude them from the hook config.",
            UserWarning,
            stacklevel=2,
        )
    return KroneckerFactors("kfac", layers, dict(covariances.diagonal), skipped)


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
            _check_shape(name, lg, eig)
            ref = _ref(lg)
            ct = _acc_dtype(ref)
            q_g = eig.q_g.to(device=ref.device, dtype=ct)
            q_a = eig.q_a.to(device=ref.device, dtype=ct)
            acc = self.sums.get(name)
            if acc is None:
                acc = self.sums[name] = torch.zeros(
                    eig.eigenvalues().shape,
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
            if name in self.exact:
                layers[name] = replace(eig, corrected=eig.eigenvalues())
                continue
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
    for item in _progress(gradients, "EK-FAC eigenvalues", progress):
        corr.update(_as_gradient(item))
    return corr.result()
