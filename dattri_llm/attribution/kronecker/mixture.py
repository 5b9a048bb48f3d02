"""A K-FAC / EK-FAC fit on a mixture of train and query gradients (TrackStar's ``mix``).

TrackStar (Chang et al., 2024) fits its Fisher on train and query gradients together, so the
preconditioner also damps directions the queries share (e.g. the template of a question). Here
every mean the fit is made of is a convex mixture of the train mean and the query mean:

* ``A = (1 − mix) A_train + mix A_query`` (each the mean of ``a aᵀ`` over its own counted token
  positions) and ``G = (1 − mix) G_train + mix G_query`` (each the mean over its own samples);
  the K-FAC eigenbases are those of the mixed ``A`` and ``G``;
* EK-FAC: ``Λ = (1 − mix) Λ_train + mix Λ_query`` with ``Λ_S = mean_{n∈S} (Q_Gᵀ M_n Q_A)²`` in
  that mixed basis;
* the diagonal Fisher of ``non_kronecker="diagonal"`` layers: the same mixture of the two means.

So ``mix = 0`` is the train-only fit and ``F̂_mix = (1 − mix) F̂_train + mix F̂_query`` holds
exactly for the diagonal Fisher and the EK-FAC eigenvalues (K-FAC mixes its factors, as
TrackStar's K-FAC does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from dattri_llm.gradient.kronecker import (
    DiagonalFisher,
    EigenvalueCorrection,
    KroneckerCovariances,
    KroneckerFactors,
    LayerCovariance,
)

__all__ = ["check_mix", "mixed_covariances", "mixed_eigenvalues", "queries_by_checkpoint"]


def check_mix(mix: Any, where: str) -> float:
    """``mix`` as a float in ``[0, 1]``; anything else raises naming ``where``."""
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix <= 1.0:
        raise ValueError(
            f"{where} must be a number in [0, 1] (the query gradients' share of the "
            f"preconditioner's fit; 0 = train only), got {mix!r}."
        )
    return float(mix)


def mixed_covariances(
    train: KroneckerCovariances, query: KroneckerCovariances, mix: float
) -> KroneckerCovariances:
    """Covariances whose means are ``(1 − mix) ×`` the train means ``+ mix ×`` the query means.

    Both are all-reduced first (under ``torch.distributed``); the result holds the mixed means
    with counts of 1 and is marked reduced.

    Raises:
        ValueError: the query gradients lack a layer of the train fit.
    """
    train.all_reduce()
    query.all_reduce()
    out = KroneckerCovariances(train.non_kronecker, train.tokens, train.dtype)
    for name, ct in train.layers.items():
        cq = query.layers.get(name)
        if cq is None or cq.num_tokens <= 0 or cq.num_samples <= 0:
            raise _not_reached(name)
        if ct.num_tokens <= 0 or ct.num_samples <= 0:
            raise ValueError(f"layer {name!r} has no train samples or no tokens carrying gradient.")
        a = (1.0 - mix) * ct.a_mean() + mix * cq.a_mean()
        g = (1.0 - mix) * ct.g_sum / ct.num_samples + mix * cq.g_sum / cq.num_samples
        ones = None if ct.block_tokens is None else torch.ones_like(ct.block_tokens)
        out.layers[name] = LayerCovariance(
            ct.layer_type, dict(ct.module_kwargs), a, g, 1.0, 1.0, ones
        )
    for name, dt in train.diagonal.items():
        dq = query.diagonal.get(name)
        if dq is None or dq.num_samples <= 0:
            raise _not_reached(name)
        sq = (1.0 - mix) * dt.sq_sum / dt.num_samples + mix * dq.sq_sum / dq.num_samples
        out.diagonal[name] = DiagonalFisher(dt.layer_type, dict(dt.module_kwargs), sq, 1.0)
    out.skipped = dict(train.skipped)
    out.reduced = True
    return out


def _not_reached(name: str) -> ValueError:
    return ValueError(
        f"mix: the query gradients do not reach layer {name!r} of the train fit; "
        "capture queries and train samples with the same hook configuration."
    )


def mixed_eigenvalues(
    fit: KroneckerFactors, train: Iterable[Any], query: Iterable[Any], mix: float
) -> KroneckerFactors:
    """EK-FAC: the eigenvalues ``(1 − mix) Λ_train + mix Λ_query`` in ``fit``'s basis.

    Args:
        fit: The (mixed) K-FAC fit whose eigenbasis is kept.
        train: Training gradients (``Gradient`` objects).
        query: Query gradients (``Gradient`` objects).
        mix: The query share.
    """
    parts = []
    for grads in (train, query):
        corr = EigenvalueCorrection(fit)
        for g in grads:
            corr.update(g)
        parts.append(corr.result())
    t, q = parts
    layers = {
        name: replace(lt, corrected=(1.0 - mix) * lt.corrected + mix * q.layers[name].corrected)
        for name, lt in t.layers.items()
    }
    return KroneckerFactors("ekfac", layers, dict(fit.diagonal), dict(fit.skipped))


def queries_by_checkpoint(source: Iterable, checkpoints: list[int]) -> dict[int, list[Any]]:
    """The query gradients for each fitted checkpoint (a single query checkpoint serves all)."""
    held: dict[int, list[Any]] = {}
    for block in source:
        gradient = getattr(block, "gradient", block)
        held.setdefault(int(getattr(block, "checkpoint", 0)), []).append(gradient)
    if not held:
        raise ValueError("mix: the query source yielded no gradients.")
    if len(held) == 1:
        only = next(iter(held.values()))
        return {c: only for c in checkpoints}
    missing = [c for c in checkpoints if c not in held]
    if missing:
        raise ValueError(
            f"mix: no query gradients at checkpoint(s) {missing} (queries at {sorted(held)}); "
            "capture the queries at every fitted checkpoint, or at one."
        )
    return {c: held[c] for c in checkpoints}
