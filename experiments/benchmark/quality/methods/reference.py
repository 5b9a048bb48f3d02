"""Reference rows: random scores (the floor) and the exact influence function (the ceiling):
``g_test^T (H + wd I)^{-1} g_train`` with ``H`` the explicit Hessian of the mean training loss
at the final checkpoint, float64, torch.func (models of at most ``MAX_EXACT_PARAMS``)."""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, hessian, vmap

from experiments.benchmark.quality.methods import Context, Method, Skipped

MAX_EXACT_PARAMS = 4000


def random_scores(ctx: Context) -> torch.Tensor:
    n, m, gen = len(ctx.setting.train), len(ctx.setting.test), torch.Generator().manual_seed(12345)
    return torch.randn(n, m, generator=gen, dtype=torch.float64)


def per_sample_flat_grads(ctx: Context, state: dict, dataset) -> torch.Tensor:
    """(n, P) per-sample gradients of the single-sample loss, float64, via torch.func."""
    model = ctx.model(state).to(torch.float64)
    params = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    x = dataset.x.to(torch.float64) if dataset.x.is_floating_point() else dataset.x

    def one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        call = lambda inp: functional_call(model, p, (inp,))  # noqa: E731
        return ctx.setting.loss_sum(call, {"x": xi[None], "y": yi[None]})

    out = []
    for s in range(0, len(x), 250):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x[s : s + 250], dataset.y[s : s + 250])
        out.append(torch.cat([g[k].reshape(g[k].shape[0], -1) for k in params], 1))
    return torch.cat(out)


def exact_if(ctx: Context) -> torch.Tensor:
    model = ctx.model().to(torch.float64)
    params = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    sizes = [v.numel() for v in params.values()]
    if sum(sizes) > MAX_EXACT_PARAMS:
        raise Skipped(f"{sum(sizes)} parameters: explicit Hessian too large for this machine")
    train = ctx.setting.train
    x = train.x.to(torch.float64)

    def objective(theta: torch.Tensor) -> torch.Tensor:
        p = {n: t.view(v.shape) for (n, v), t in zip(params.items(), theta.split(sizes))}
        call = lambda inp: functional_call(model, p, (inp,))  # noqa: E731
        return ctx.setting.loss_sum(call, {"x": x, "y": train.y}) / len(x)

    theta0 = torch.cat([v.reshape(-1) for v in params.values()])
    wd = ctx.setting.weight_decay * torch.eye(sum(sizes), dtype=torch.float64)
    h = hessian(objective)(theta0) + wd
    g_train = per_sample_flat_grads(ctx, ctx.final, train)
    g_test = per_sample_flat_grads(ctx, ctx.final, ctx.setting.test)
    return g_train @ torch.linalg.solve(h, g_test.T)


METHODS = [
    Method("Random", "reference", random_scores, "N(0,1) scores, fixed seed"),
    Method(
        "Exact IF (explicit Hessian)",
        "reference",
        exact_if,
        "float64, H of the mean train loss + wd*I",
    ),
]
