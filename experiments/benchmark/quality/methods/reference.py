"""Reference rows: random scores (the floor) and the exact-Hessian influence function (ceiling).

The exact IF is an independent implementation (torch.func, float64, explicit Hessian of the
training objective including its L2 term): ``score(i, j) = g_j^T (H + wd I)^{-1} g_i`` with
``H`` the Hessian of the mean training loss at the final reference checkpoint. It is only
formed when the model has at most ``MAX_EXACT_PARAMS`` parameters (digits-LR: 650).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, hessian, vmap

from experiments.benchmark.quality.methods import Context, Method, Skipped

MAX_EXACT_PARAMS = 4000


def random_scores(ctx: Context) -> torch.Tensor:
    gen = torch.Generator().manual_seed(12345)
    return torch.randn(
        len(ctx.setting.train), len(ctx.setting.test), generator=gen, dtype=torch.float64
    )


def per_sample_flat_grads(ctx: Context, state: dict, dataset) -> torch.Tensor:
    """(n, P) per-sample gradients of the single-sample loss, float64, via torch.func."""
    model = ctx.model(state).to(torch.float64)
    params = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    x = dataset.x.to(torch.float64) if dataset.x.is_floating_point() else dataset.x

    def one(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return ctx.setting.loss_sum(model_call(p), {"x": xi[None], "y": yi[None]})

    def model_call(p: dict):
        return lambda inp: functional_call(model, p, (inp,))

    out = []
    for s in range(0, len(x), 250):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, x[s : s + 250], dataset.y[s : s + 250])
        out.append(torch.cat([g[k].reshape(g[k].shape[0], -1) for k in params], 1))
    return torch.cat(out)


def exact_if(ctx: Context) -> torch.Tensor:
    model = ctx.model().to(torch.float64)
    params = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    n_params = sum(v.numel() for v in params.values())
    if n_params > MAX_EXACT_PARAMS:
        raise Skipped(f"{n_params} parameters: explicit Hessian too large for this machine")
    names, shapes = list(params), [v.shape for v in params.values()]
    sizes = [v.numel() for v in params.values()]
    theta0 = torch.cat([v.reshape(-1) for v in params.values()])
    train = ctx.setting.train
    x = train.x.to(torch.float64)

    def objective(theta: torch.Tensor) -> torch.Tensor:
        p = {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes)}
        loss = ctx.setting.loss_sum(
            lambda inp: functional_call(model, p, (inp,)), {"x": x, "y": train.y}
        )
        return loss / len(x)

    h = hessian(objective)(theta0) + ctx.setting.weight_decay * torch.eye(
        n_params, dtype=torch.float64
    )
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
