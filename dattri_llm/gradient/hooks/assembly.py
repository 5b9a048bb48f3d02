"""Assembling a captured step from what the hooks saw: outputs to hook, calls to join.

* :func:`output_tensors` — the model output's tensors, hooked so that a backward through the
  model always ends a step (one that captures nothing is reported);
* :func:`grad_target` — which tensor a layer's output-gradient hook goes on (views rebased by
  in-place ops would never fire it);
* :func:`merge_calls` — a module called several times in one step has the sum of its calls'
  gradients (factors joined along the token axis), unless the calls are sub-batches of the
  model's batch (memory chunking), which are joined along the batch axis;
* :func:`param_item` — a ``param_grad`` layer's (batch) gradient as a one-row item.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dattri_llm.gradient.hooks.config import LayerSpec
from dattri_llm.gradient.layer_gradient import (
    Factorized,
    LayerGradient,
    Materialized,
    Shared,
    concat_layer,
)

__all__ = [
    "first_tensor",
    "grad_target",
    "merge_calls",
    "output_tensors",
    "param_item",
    "ref_tensor",
]


def first_tensor(x: Any) -> torch.Tensor | None:
    """The first tensor of a module output (a tensor, or a tuple / list starting with one)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def output_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of a model output: a tensor, or those of a tuple / list / mapping of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    values = x.values() if isinstance(x, Mapping) else x if isinstance(x, (tuple, list)) else ()
    return [v for v in values if isinstance(v, torch.Tensor)]


def grad_target(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tensor to hook, output to return)`` for a hooked layer's output.

    A hook registered on a *view* (``nn.Linear`` / HF ``Conv1D`` on inputs with 3 or more
    dims, InstanceNorm) never fires once an in-place op (``ReLU(inplace=True)``,
    ``out += residual``) rebases the view's history. A view that is its whole base reshaped is
    hooked through the base instead, whose gradient is the output's (no copy); any other view
    is replaced by a copy.
    """
    base = out._base
    if base is None:
        return out, out
    if (
        base.grad_fn is not None
        and base.is_contiguous()
        and out.is_contiguous()
        and base.numel() == out.numel()
        and base.storage_offset() == out.storage_offset()
    ):
        return base, out
    copy = out.clone()
    return copy, copy


def merge_calls(
    items: list[tuple[int, LayerGradient]], batch_size: int | None = None, name: str = ""
) -> LayerGradient:
    """Join the calls of a module in one step.

    Calls that each see the whole batch add up: factors are joined along the token axis, dense
    gradients summed. Calls on *sub-batches* (a forward that runs a layer once per chunk of
    the batch, ``torch.cat([fc(c) for c in x.split(2)])``) are joined along the batch axis in
    call order, when their rows add up to the model's batch ``batch_size``: the chunk of the
    ``i``-th call is taken to be the ``i``-th slice of the batch, as ``split`` / ``chunk`` and
    ``cat`` give. Any other mix of batch sizes cannot be told apart and is refused.

    Args:
        items: ``(forward order, one call's gradient)`` pairs.
        batch_size: The model's batch size, if the manager saw the model's inputs.
        name: The layer's name (for the error).
    """
    items = sorted(items, key=lambda x: x[0])
    parts = [it for _, it in items]
    if len(parts) == 1:
        return parts[0]
    sizes = [p.batch_size for p in parts]
    if batch_size is not None and any(s != batch_size for s in sizes):
        if sum(sizes) == batch_size:
            return concat_layer(parts)
        raise RuntimeError(
            f"layer {name!r} was called {len(parts)} times in one step on batches of {sizes} "
            f"rows, while the model's batch has {batch_size}: neither whole-batch calls (whose "
            "gradients add) nor sub-batches that add up to the batch (joined in call order), so "
            "its rows cannot be assigned to samples. Call the layer once per sample chunk that "
            "partitions the batch, or exclude it (HookManagerConfig(exclude=[...]))."
        )
    if len(set(sizes)) > 1:
        raise RuntimeError(
            f"layer {name!r} was called {len(parts)} times in one step on batches of {sizes} "
            "rows, and the model's batch size is unknown (its inputs were not seen), so the "
            "calls cannot be joined: call the model itself so the manager sees its batch, or "
            "exclude the layer (HookManagerConfig(exclude=[...]))."
        )
    if all(isinstance(p, Factorized) for p in parts):
        rule = parts[0].rule
        return Factorized(
            rule.concat_tokens([p.a for p in parts]),
            rule.concat_tokens([p.g for p in parts]),
            parts[0].layer_type,
            parts[0].module_kwargs,
        )
    total = sum(p.materialize().data for p in parts)
    return Materialized(total, parts[0].layer_type, parts[0].module_kwargs)


def param_item(
    spec: LayerSpec, grads: dict | None, b: int, ref: torch.Tensor | None
) -> LayerGradient | None:
    """A ``param_grad`` layer's gradient as a one-row item (refused for batches > 1)."""
    params = [(n, p) for n, p in spec.module.named_parameters(recurse=False) if p.requires_grad]
    if b != 1:
        raise RuntimeError(
            f"layer {spec.name!r} is hooked with param_grad, which sees the batch gradient; "
            f"per-sample gradients need batch size 1 (got {b}). Use linear_io or batch size 1."
        )
    vecs = []
    for n, p in params:
        gp = (grads or {}).get(n)
        vecs.append((gp if gp is not None else torch.zeros_like(p)).reshape(1, -1))
    data = torch.cat(vecs, dim=1)
    if ref is not None:
        data = data.to(ref.dtype)
    return Materialized(data, "param_grad", {"params": [[n, list(p.shape)] for n, p in params]})


def ref_tensor(layers: dict[str, LayerGradient]) -> torch.Tensor | None:
    """A tensor of the step (its dtype and device), or ``None`` for an empty step."""
    for lg in layers.values():
        while isinstance(lg, Shared):
            lg = lg.sites[0]
        return lg.g if isinstance(lg, Factorized) else lg.data
    return None
