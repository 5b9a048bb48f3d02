"""Helpers of the Kronecker fits: fit shapes, gradient items, progress, rank agreement."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.layers import get_rule
from dattri_llm.utils.distributed import all_reduce_sum, get_rank, get_world_size

__all__ = ["fit_shapes", "DiagonalFisher"]


@dataclass
class DiagonalFisher:
    """Exact diagonal empirical Fisher of a non-Kronecker layer: ``sum_n m_n^2`` and ``N``."""

    layer_type: str
    module_kwargs: dict
    sq_sum: torch.Tensor
    num_samples: float = 0.0


def _put_diagonal(diagonal: dict[str, DiagonalFisher], tensors: dict) -> dict:
    """Add the diagonal Fishers' tensors to ``tensors``; return their JSON metadata."""
    meta = {}
    for name, dg in diagonal.items():
        tensors[f"{name}|sq_sum"] = dg.sq_sum
        meta[name] = {
            "layer_type": dg.layer_type,
            "module_kwargs": dg.module_kwargs,
            "num_samples": dg.num_samples,
        }
    return meta


def _get_diagonal(tensors: dict, meta: dict, path: str | os.PathLike) -> dict:
    """The diagonal Fishers described by ``meta["diagonal"]``, validated."""
    out = {}
    for name, m in meta["diagonal"].items():
        t = tensors.get(f"{name}|sq_sum")
        if t is None or t.dim() != 1:
            raise ValueError(f"{path}: diagonal Fisher of {name!r} is missing or not 1-D.")
        out[name] = DiagonalFisher(m["layer_type"], m["module_kwargs"], t, float(m["num_samples"]))
    return out


def fit_shapes(layer_type: str, kw: dict) -> tuple[tuple[int, ...], int, int]:
    """``(leading block axis, K, D)`` of one layer's fit: ``((), K, D)`` or ``((E,), K/E, D)``."""
    rule = get_rule(layer_type)
    k, d = rule.matrix_shape(kw)
    blocks = rule.kronecker_blocks(kw)
    return ((blocks,) if blocks > 1 else ()), k // blocks, d


def _as_gradient(item: object) -> Gradient:
    if isinstance(item, Gradient):
        return item
    grad = getattr(item, "gradient", None)
    if isinstance(grad, Gradient):
        return grad
    raise TypeError(f"expected a Gradient, GradientRecord or GradientBlock, got {type(item)}")


def _progress(items: Iterable, desc: str, enabled: bool | None) -> Iterable:
    from dattri_llm.utils.progress import progress

    return items if get_rank() != 0 else progress(items, enabled, desc=desc)


def _check_same_layers(names: list[str], device: torch.device | None = None) -> None:
    """Fail loudly when ranks accumulated different layer sets (all-reduce would misalign)."""
    code = float(zlib.crc32("\n".join(names).encode()))
    t = all_reduce_sum(torch.tensor([code, code * code], dtype=torch.float64, device=device))
    w = get_world_size()
    if t[0] != code * w or t[1] != code * code * w:
        raise RuntimeError(
            "ranks accumulated different layer sets; every rank must capture the "
            "same layers before the Kronecker all-reduce."
        )
