"""Independent references for the tests: per-sample gradients by torch.func."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def per_sample_grads(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, dict], torch.Tensor],
    batch: dict[str, torch.Tensor],
    names: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """``{param name: (B, *shape)}``: the gradient of ``loss_fn`` on each row alone."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    class _Bound(nn.Module):
        pass

    def one(p: dict, row: dict) -> torch.Tensor:
        batched = {k: v.unsqueeze(0) for k, v in row.items()}

        class Proxy(nn.Module):
            def __call__(self, *args, **kwargs):
                return functional_call(model, ({**p, **buffers}), args, kwargs)

        return loss_fn(Proxy(), batched)

    grads = vmap(grad(one), in_dims=(None, 0))(params, batch)
    if names is not None:
        grads = {k: grads[k] for k in names}
    return grads


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """Concatenate per-sample gradients into ``(B, P)``."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Max abs error relative to the max magnitude of the reference."""
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-300))
