"""Per-sample gradients by ``torch.func`` (``vmap(grad)`` over ``functional_call``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = ["vmap_per_sample_grads", "flat_gram", "rel_err"]


def vmap_per_sample_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{param name: (B, *shape)}`` per-sample gradients of each sample's mean token loss.

    Tied parameters appear once (``named_parameters`` de-duplicates them) and receive the sum
    over their sites, as in the real model.
    """
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x[None]
        return functional_call(model, p, (), {"input_ids": x, "labels": x}).loss

    return vmap(grad(one), in_dims=(None, 0))(params, ids)


def flat_gram(per_sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(B, B)`` Gram of flattened per-sample gradients (accumulated parameter by parameter)."""
    total = None
    for g in per_sample.values():
        f = g.reshape(g.shape[0], -1)
        part = f @ f.T
        total = part if total is None else total + part
    assert total is not None
    return total


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref| / max |ref|`` (normwise: single entries of ``ref`` can be near zero)."""
    return float((x.double() - ref).abs().max() / ref.abs().max())
