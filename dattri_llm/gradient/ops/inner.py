"""Routed inner products of captured gradients; every mode is exact, only the cost differs.

The container-level API over :class:`~dattri_llm.gradient.gradient.Gradient`; the maths on each
layer's forms is in :mod:`dattri_llm.gradient.layer_inner`, which the container uses too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.layer_inner import (
    cross_gram,
    cross_gram_per_token,
    layer_cross_dot,
    layer_cross_dot_per_token,
    norm_sq,
)

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import Gradient

__all__ = [
    "dot",
    "pairwise_dot",
    "cross_dot",
    "cross_dot_per_token",
    "grad_norm_sq",
    "materialize",
    "layer_cross_dot",
    "layer_cross_dot_per_token",
]


def cross_dot(
    x: Gradient, y: Gradient, mode: str = "auto", per_layer: bool = False
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Gram block ``(B1, B2)`` between two captures of the same layers.

    Args:
        x: Left capture.
        y: Right capture.
        mode: ``"auto"``, ``"factorized"`` or ``"materialized"``.
        per_layer: Return ``{layer: (B1, B2)}`` instead of the sum over layers.
    """
    return cross_gram(x.layers, y.layers, mode, per_layer)


def cross_dot_per_token(
    x: Gradient, y: Gradient, mode: str = "auto", per_layer: bool = False
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Per-token contributions ``(B1, T1, B2)`` of ``x``'s positions; sums to :func:`cross_dot`.

    Every layer of ``x`` must be factorised and share one token count ``T1``.
    """
    return cross_gram_per_token(x.layers, y.layers, mode, per_layer)


def pairwise_dot(x: Gradient, mode: str = "auto") -> torch.Tensor:
    """Gram matrix ``(B, B)`` of one capture."""
    return cross_dot(x, x, mode=mode)


def grad_norm_sq(x: Gradient, mode: str = "auto") -> torch.Tensor:
    """Squared norms ``(B,)`` of the per-sample gradients (summed over layers)."""
    return norm_sq(x.layers, mode)


def dot(x: Gradient, y: Gradient, mode: str = "auto") -> torch.Tensor:
    """Per-sample inner products ``<x_i, y_i>`` ``(B,)`` of two captures of the same batch."""
    if x.batch_size != y.batch_size:
        raise ValueError(f"dot needs equal batch sizes, got {x.batch_size} and {y.batch_size}")
    rows = [
        torch.diagonal(cross_dot(x.slice([i]), y.slice([i]), mode=mode))
        for i in range(x.batch_size)
    ]
    return torch.cat(rows)


def materialize(x: Gradient) -> Gradient:
    """Every layer as a dense ``(B, P)`` per-sample gradient."""
    return x.materialize()
