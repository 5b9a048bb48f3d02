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


def per_sample_loop_grads(
    model: nn.Module, loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor], x: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``{param name: (B, *shape)}`` by one backward pass per sample (any model: in-place ops,
    checkpointing, tied weights); parameters that get no gradient read as zeros. Only the
    parameters that require grad are returned."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    saved = {n: p.grad for n, p in params.items()}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    try:
        for i in range(x.shape[0]):
            for p in params.values():
                p.grad = None
            loss_fn(model, x[i : i + 1]).backward()
            for n, p in params.items():
                rows[n].append(torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
    finally:
        for n, p in params.items():
            p.grad = saved[n]
    return {n: torch.stack(r) for n, r in rows.items()}


def captured_by_parameter(hm, gradient, model: nn.Module) -> dict[str, torch.Tensor]:
    """``{param name: (B, *shape)}`` of a captured step, through ``HookManager.layer_parameters``
    and the layer rules' ``unflatten`` (names as in ``model.named_parameters()``)."""
    names = {id(p): n for n, p in model.named_parameters()}
    mapping = hm.layer_parameters()
    out: dict[str, torch.Tensor] = {}
    for layer, lg in gradient.layers.items():
        dense = lg.materialize()
        if dense.layer_type == "param_grad":
            sizes = [(n, shape) for n, shape in dense.module_kwargs["params"]]
            chunks = dense.data.split([int(torch.tensor(s).prod()) for _, s in sizes], dim=1)
            parts = {n: c.reshape(-1, *s) for (n, s), c in zip(sizes, chunks)}
        else:
            parts = dense.rule.unflatten(dense.data, dense.module_kwargs)
        assert set(parts) == set(mapping[layer]), (layer, set(parts), set(mapping[layer]))
        for pname, value in parts.items():
            full = names[id(mapping[layer][pname])]
            assert full not in out, f"parameter {full} captured by two layers"
            out[full] = value
    return out


def assert_same_formula(got: torch.Tensor, want: torch.Tensor, terms: int = 1024) -> None:
    """``got`` and ``want`` are one formula evaluated on bit-identical inputs.

    Equal up to summation order, not bit for bit: a reloaded tensor may have another memory
    layout than the one in memory, an optional extra (``opt_einsum``) another contraction
    order, and a kernel sums in blocks chosen by layout. Reordering a sum of at most ``terms``
    terms moves it by at most ``terms * eps`` of the terms' size; the bound is taken relative
    to the largest entry (the tests' tensors do not cancel to round-off). Stored tensors are
    compared with ``torch.equal`` instead: those are exact by construction.
    """
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    tol = terms * torch.finfo(want.dtype).eps * float(want.abs().max().clamp_min(1e-300))
    err = float((got - want).abs().max()) if got.numel() else 0.0
    assert err <= tol, f"differ by {err:.3g} (allowed {tol:.3g}, {want.dtype})"
