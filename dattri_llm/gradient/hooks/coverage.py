"""Coverage check: do the captured per-sample gradients add up to autograd's weight gradient?

Hooks see a weight only through its module's forward. A weight also used *outside* the module
(a functional tie such as ``F.linear(h, wte.weight)``, a fused LM head reading
``lm_head.weight``) gets gradient the hooks never see, and the captured per-sample gradients
silently miss that share. The check runs once per manager, on the first captured step: in the
weight's gradient hook (which receives the whole gradient of this backward pass), the captured
per-sample gradients of every site of that weight are summed over the batch (one contraction
per site, ``batch_sum``) and compared with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dattri_llm.gradient.gradient import Factorized, Materialized

__all__ = [
    "batch_weight_gradient",
    "coverage_gap",
    "coverage_message",
    "site_coverage_gap",
    "tolerance",
]

_HALF = (torch.float16, torch.bfloat16)


def batch_weight_gradient(items: Sequence[Any], rule: Any, kwargs: dict) -> torch.Tensor | None:
    """Sum over samples (and calls) of one site's captured gradients, as the ``weight`` tensor.

    Args:
        items: The site's buffered :class:`Factorized` / :class:`Materialized` items.
        rule: The site's layer rule.
        kwargs: The site's module kwargs.

    Returns:
        The batch-summed weight gradient, or ``None`` for items the check cannot sum.
    """
    total = None
    for item in items:
        if not isinstance(item, (Factorized, Materialized)):
            return None
        part = rule.unflatten(item.batch_sum().data, kwargs).get("weight")
        if part is None:
            return None
        part = part[0].to(torch.float64)
        total = part if total is None else total + part
    return total


def coverage_gap(captured: torch.Tensor, autograd: torch.Tensor) -> float:
    """Relative difference ``|captured - autograd| / |autograd|`` (max norms)."""
    ref = autograd.detach().to(torch.float64)
    scale = float(ref.abs().max())
    if scale == 0.0:
        return 0.0 if float(captured.abs().max()) == 0.0 else float("inf")
    return float((captured - ref).abs().max()) / scale


def site_coverage_gap(
    sites: Sequence[tuple[Sequence[Any], Any, dict]], grad: torch.Tensor
) -> float | None:
    """Gap between a weight's autograd gradient and the batch sum over all its sites' items.

    Args:
        sites: ``(items, rule, module_kwargs)`` of every site sharing the weight.
        grad: The weight's gradient of this backward pass.

    Returns:
        The relative gap, or ``None`` when the two cannot be compared (sparse, sharded, an
        item type or layout the check does not sum).
    """
    if grad.is_sparse or type(grad).__name__ == "DTensor":  # FSDP2 shard: not comparable
        return None
    total = None
    for items, rule, kwargs in sites:
        part = batch_weight_gradient(items, rule, kwargs)
        if part is None or tuple(part.shape) != tuple(grad.shape):
            return None
        total = part if total is None else total + part
    return None if total is None else coverage_gap(total, grad)


def tolerance(sites: Sequence[tuple[Sequence[Any], Any, dict]], grad: torch.Tensor) -> float:
    """Allowed gap: round-off of the captured dtype (half types sum far less exactly)."""
    dtypes = {grad.dtype}
    for items, _, _ in sites:
        for item in items:
            dtypes.add(item.g.dtype if isinstance(item, Factorized) else item.data.dtype)
    return 5e-2 if dtypes & set(_HALF) else 1e-3


def coverage_message(
    name: str, specs: Sequence[Any], buffers: dict[str, list], grad: torch.Tensor
) -> str | None:
    """The warning for weight ``name`` if its captured gradients miss part of ``grad``.

    Args:
        name: The first hooked site of the weight.
        specs: Every hooked site (``LayerSpec``) sharing the weight.
        buffers: The manager's step buffers, ``{layer: [(order, item), ...]}``.
        grad: The weight's gradient of this backward pass.

    Returns:
        The message, or ``None`` when the gradients agree or cannot be compared.
    """
    sites = [
        ([item for _, item in buffers[s.name]], s.rule, s.module_kwargs)
        for s in specs
        if s.name in buffers
    ]
    gap = site_coverage_gap(sites, grad) if sites else None  # no site ran: bypass warning
    if gap is None or gap <= tolerance(sites, grad):
        return None
    return (
        f"layer {name!r}: the captured per-sample gradients sum to a weight gradient that "
        f"differs from autograd's by {gap:.1%} (relative, first step): the weight is also used "
        f"outside the hooked module(s) {[s.name for s in specs]}, e.g. a functional tie such "
        "as F.linear(h, wte.weight), so that share is missing from the captured gradients. "
        f"Call the module instead, or exclude the layer (HookManagerConfig(exclude=[{name!r}]))"
        "; check_coverage=False silences this."
    )
