"""Brute-force references for the trajectory tests (LESS, AdamW-influence, DVEmb, recording).

Nothing here uses dattri_llm's maths: per-sample gradients come from ``torch.func``
(``functional_call`` + ``vmap(grad)``), optimizer updates are written out from torch's own
update rules (and checked against the real ``torch.optim`` step in ``test_reference_*``), the
linearised optimizer steps are explicit dense matrices, and exact derivatives / leave-one-out
come from an explicitly unrolled, differentiable copy of the training loop.

Layouts: the library lays a layer's gradient out in its rule's matrix form (``nn.Linear``:
``[W | b]`` row-major ``(out, in+1)``; ``nn.LayerNorm``: ``[weight; bias]`` ``(2, C)``;
``nn.Embedding``: ``(V, E)``); :func:`matrix_form` writes that layout out by hand so explicit
quantities can be compared coordinate by coordinate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

DT = torch.float64

# ---- models --------------------------------------------------------------------------------------
V, E = 11, 6


class TiedLM(nn.Module):
    """Embedding + LayerNorm + Linear + an LM head tied to the embedding (GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.norm = nn.LayerNorm(E)
        self.fc = nn.Linear(E, E)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(input_ids))
        h = h + torch.tanh(self.fc(h))
        return self.head(h)


def make_lm(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    m = TiedLM().double()
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        m.norm.weight.add_(0.3 * torch.randn(E, dtype=DT))
        m.norm.bias.add_(0.2 * torch.randn(E, dtype=DT))
    return m


def lm_sample_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence next-token cross-entropy, summed over positions ``(B,)``."""
    b = ids.shape[0]
    ce = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none"
    )
    return ce.reshape(b, -1).sum(1)


def lm_batch(n: int, t: int = 5, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, V, (n, t), generator=g)}


class MLP(nn.Module):
    """A 2-layer MLP classifier."""

    def __init__(self, d_in: int = 4, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_mlp(seed: int = 0, **kw) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kw).double()


def mlp_sample_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y, reduction="none")


# ---- per-sample gradients by torch.func ----------------------------------------------------------
def per_sample_grads(
    model: nn.Module,
    sample_loss: Callable[[torch.Tensor, dict], torch.Tensor],
    batch: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``{param name: (B, *shape)}``: the gradient of each row's own loss.

    ``sample_loss(outputs, row_batch)`` returns the ``(1,)`` loss of a one-row batch;
    tied parameters appear once (``named_parameters`` de-duplicates) and ``functional_call``
    keeps them tied, so their gradient is the sum over sites.
    """
    params = params if params is not None else {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, row: dict) -> torch.Tensor:
        row = {k: v.unsqueeze(0) for k, v in row.items()}
        inputs = {k: v for k, v in row.items() if k != "y"}
        out = functional_call(model, p, (), inputs)
        return sample_loss(out, row).sum()

    return vmap(grad(one), in_dims=(None, 0))(params, batch)


def lm_loss_row(logits: torch.Tensor, row: dict) -> torch.Tensor:
    return lm_sample_losses(logits, row["input_ids"])


def mlp_loss_row(logits: torch.Tensor, row: dict) -> torch.Tensor:
    return mlp_sample_losses(logits, row["y"])


# ---- the library's layout, written out -----------------------------------------------------------
def matrix_form(module: nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """``(B, K*D)`` rows in the layer's matrix form from ``{"weight": (B, ...), "bias": ...}``."""
    w = tensors["weight"]
    b = w.shape[0]
    if isinstance(module, nn.Linear):
        if "bias" in tensors:
            return torch.cat([w, tensors["bias"].unsqueeze(-1)], dim=-1).reshape(b, -1)
        return w.reshape(b, -1)
    if isinstance(module, nn.LayerNorm):
        return torch.stack([w, tensors["bias"]], dim=1).reshape(b, -1)
    if isinstance(module, nn.Embedding):
        return w.reshape(b, -1)
    raise TypeError(type(module))


def layer_rows(
    model: nn.Module, per_param: dict[str, torch.Tensor], layers: Sequence[str]
) -> dict[str, torch.Tensor]:
    """``{layer: (B, K*D)}`` from ``{param name: (B, *shape)}`` (tied names: the lead's)."""
    modules = dict(model.named_modules())
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for layer in layers:
        mod = modules[layer]
        t = {
            pn: per_param[by_id[id(p)]]
            for pn, p in mod.named_parameters(recurse=False)
            if id(p) in by_id
        }
        out[layer] = matrix_form(mod, t)
    return out


def param_rows(model: nn.Module, tensors: dict[str, torch.Tensor], layers: Sequence[str]):
    """Like :func:`layer_rows` for parameter-shaped tensors (no batch axis) -> ``(K*D,)``."""
    rows = layer_rows(model, {k: v.unsqueeze(0) for k, v in tensors.items()}, layers)
    return {k: v[0] for k, v in rows.items()}


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Max abs error relative to the max magnitude of the reference ``y``."""
    return float((x - y).abs().max() / y.abs().max().clamp_min(1e-300))


def fro_rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """Frobenius-norm relative error."""
    return float((x - y).norm() / y.norm())


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.flatten() - x.mean(), y.flatten() - y.mean()
    return float((x @ y) / (x.norm() * y.norm()))


# ---- optimizer maths by hand (torch.optim's update rules, parameter-shaped) ----------------------
def adam_direction(g: torch.Tensor, theta: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """The Adam/AdamW update direction from the pre-step ``state`` if ``g`` were the gradient.

    ``θ' = θ(1 − ηλ_decoupled) − η Γ`` with torch's bias corrections and ``ε`` placement.
    """
    b1, b2 = group["betas"]
    if group.get("maximize"):
        g = -g
    decoupled = group.get("decoupled_weight_decay", False)
    if group["weight_decay"] and not decoupled:
        g = g + group["weight_decay"] * theta
    step = int(state["step"]) if state else 0
    c = step + 1
    m0 = state["exp_avg"] if state else torch.zeros_like(theta)
    v0 = state["exp_avg_sq"] if state else torch.zeros_like(theta)
    m = b1 * m0 + (1 - b1) * g
    v = b2 * v0 + (1 - b2) * g * g
    if group["amsgrad"]:
        vmax0 = state["max_exp_avg_sq"] if state else torch.zeros_like(theta)
        v = torch.maximum(vmax0, v)
    bc1, bc2 = 1 - b1**c, 1 - b2**c
    return (m / bc1) / (v.sqrt() / bc2**0.5 + group["eps"])


def sgd_direction(g: torch.Tensor, theta: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """torch.optim.SGD's direction ``θ' = θ − η Γ`` if ``g`` were the gradient."""
    if group.get("maximize"):
        g = -g
    if group["weight_decay"]:
        g = g + group["weight_decay"] * theta
    mu = group["momentum"]
    if mu == 0:
        return g
    buf = state.get("momentum_buffer") if state else None
    b = g.clone() if buf is None else mu * buf + (1 - group["dampening"]) * g
    return g + mu * b if group["nesterov"] else b


def explicit_directions(model: nn.Module, opt: torch.optim.Optimizer, grads: dict) -> dict:
    """``{param name: (B, *shape)}``: each row's update direction, from ``opt``'s current state."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            n = by_id[id(p)]
            st = opt.state.get(p, {})
            fn = sgd_direction if isinstance(opt, torch.optim.SGD) else adam_direction
            out[n] = torch.stack([fn(g, p.detach(), st, group) for g in grads[n]])
    return out


def direction_by_real_step(
    model: nn.Module, opt: torch.optim.Optimizer, grads: dict, row: int
) -> dict[str, torch.Tensor]:
    """Oracle: run the real ``opt.step()`` on a copy with ``p.grad = g_row`` and read Γ back.

    ``Γ = ((1 − ηλ_d)θ − θ') / η`` (``λ_d`` AdamW's decoupled decay).
    """
    import copy

    m2, o2 = copy.deepcopy((model, opt))  # one memo: the copy steps the copied parameters
    assert {id(p) for g in o2.param_groups for p in g["params"]} == {id(p) for p in m2.parameters()}
    names = [n for n, _ in m2.named_parameters()]
    before = {n: p.detach().clone() for n, p in m2.named_parameters()}
    for n, p in m2.named_parameters():
        p.grad = grads[n][row].clone()
    o2.step()
    out = {}
    by_id = {id(p): n for n, p in m2.named_parameters()}
    for group in o2.param_groups:
        lr = group["lr"]
        decay = 0.0
        if not isinstance(o2, torch.optim.SGD) and group.get("decoupled_weight_decay", False):
            decay = group["weight_decay"]
        for p in group["params"]:
            n = by_id[id(p)]
            out[n] = ((1 - lr * decay) * before[n] - p.detach()) / lr
    assert set(out) == set(names)
    return out


# ---- flat parameter vectors and an explicitly unrolled training loop -----------------------------
class Flat:
    """A model's trainable parameters as one vector (``named_parameters`` order)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.sizes = [p.numel() for _, p in model.named_parameters()]
        self.P = sum(self.sizes)

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(theta, self.sizes)
        return {n: x.reshape(s) for n, x, s in zip(self.names, parts, self.shapes)}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def of_model(self, model: nn.Module | None = None) -> torch.Tensor:
        m = model if model is not None else self.model
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    def state(self, opt: torch.optim.Optimizer, key: str) -> torch.Tensor:
        ps = list(self.model.parameters())
        return torch.cat([opt.state[p][key].detach().clone().reshape(-1) for p in ps])

    def losses(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-sample losses ``(B,)`` at ``theta`` (differentiable)."""
        out = functional_call(self.model, self.unflatten(theta), (x,))
        return mlp_sample_losses(out, y)

    def sample_grads(self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``(B, P)`` per-sample gradients by ``vmap(grad)``."""

        def one(th, xi, yi):
            return self.losses(th, xi[None], yi[None]).sum()

        return vmap(grad(one), in_dims=(None, 0, 0))(theta.detach(), x, y)


@dataclass
class Hyper:
    """An optimizer's hyper-parameters for the functional steps."""

    kind: str  # "adam" or "sgd"
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True
    amsgrad: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False


def adam_step(theta, m, v, vmax, g, count: int, h: Hyper, lr: float):
    """One torch Adam / AdamW update on flat vectors (differentiable); ``g`` the batch gradient
    as the optimizer receives it (after clipping)."""
    if h.weight_decay and not h.decoupled:
        g = g + h.weight_decay * theta
    if h.weight_decay and h.decoupled:
        theta = theta * (1 - lr * h.weight_decay)
    m = h.beta1 * m + (1 - h.beta1) * g
    v = h.beta2 * v + (1 - h.beta2) * g * g
    used = torch.maximum(vmax, v) if h.amsgrad else v
    bc1, bc2 = 1 - h.beta1**count, 1 - h.beta2**count
    theta = theta - lr / bc1 * m / (used.sqrt() / bc2**0.5 + h.eps)
    return theta, m, v, (used if h.amsgrad else vmax)


def sgd_step(theta, buf, g, h: Hyper, lr: float):
    """One torch SGD update on flat vectors (``buf`` ``None`` before the first momentum step)."""
    if h.weight_decay:
        g = g + h.weight_decay * theta
    if h.momentum:
        buf = g if buf is None else h.momentum * buf + (1 - h.dampening) * g
        d = g + h.momentum * buf if h.nesterov else buf
    else:
        d = g
    return theta - lr * d, buf


def clip_coef(g: torch.Tensor, max_norm: float | None) -> torch.Tensor | float:
    """``torch.nn.utils.clip_grad_norm_``'s factor (differentiable): min(1, C / (‖g‖ + 1e-6))."""
    if max_norm is None:
        return 1.0
    return torch.clamp(max_norm / (g.norm() + 1e-6), max=1.0)


# ---- a recorded MLP training run (hand-written loop) and its brute-force references --------------
@dataclass
class Run:
    """A short training run of an MLP captured with the library, plus what the references need.

    Attributes (flat vectors in ``named_parameters`` order):
        schedule: the sample indices of each step's batch.
        thetas: θ_t each step ran from, and θ_T last.
        pre, post: the optimizer's per-step state before / after ``step()`` (flat).
        consumed: the batch gradient the optimizer received (after clipping, before its own
            coupled weight decay); grad_before_clip: before clipping.
        max_norms: the clipping threshold of each step (``None``: no clipping).
    """

    model: nn.Module
    flat: Flat
    hyper: Hyper
    X: torch.Tensor
    Y: torch.Tensor
    XQ: torch.Tensor
    YQ: torch.Tensor
    schedule: list[list[int]]
    lrs: list[float]
    reduction: str
    thetas: list[torch.Tensor]
    pre: list[dict]
    post: list[dict]
    consumed: list[torch.Tensor]
    grad_before_clip: list[torch.Tensor]
    max_norms: list[float] | None
    ids: list[str]
    qids: list[str]
    extra: dict


def _flat_state(flat: Flat, opt: torch.optim.Optimizer, hyper: Hyper) -> dict:
    ps = list(flat.model.parameters())
    st = [opt.state.get(p, {}) for p in ps]
    zeros = torch.zeros(flat.P, dtype=DT)

    def cat(key):
        if not all(key in s for s in st):
            return None
        return torch.cat([s[key].detach().clone().reshape(-1) for s in st])

    if hyper.kind == "adam":
        count = int(st[0]["step"]) if st[0] else 0
        return {
            "count": count,
            "m": cat("exp_avg") if count else zeros.clone(),
            "v": cat("exp_avg_sq") if count else zeros.clone(),
            "vmax": (cat("max_exp_avg_sq") if count else zeros.clone()) if hyper.amsgrad else None,
        }
    return {"buf": cat("momentum_buffer")}


def record_mlp_run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    hyper: Hyper,
    data: tuple,
    schedule: list[list[int]],
    lrs: list[float],
    callbacks_for: Callable[[nn.Module, torch.optim.Optimizer], list],
    manager_kw: dict | None = None,
    reduction: str = "sum",
    clip_factors: list[float] | None = None,
    warm: tuple | None = None,
    on_step: Callable | None = None,
) -> Run:
    """Train ``model`` with ``opt`` on ``schedule`` under a HookManager (hand-written loop).

    ``warm = (X, Y, steps)``: real warm-up steps before the captured window. ``clip_factors``:
    clip each step's gradient norm to that fraction of itself (``clip_grad_norm_``).
    ``on_step(t, hm, batch)`` runs before each step's backward (e.g. a curvature capture).
    """
    from dattri_llm import HookManager
    from dattri_llm.utils.hashing import hash_batch

    X, Y, XQ, YQ = data
    flat = Flat(model)

    def loss_of(x, y):
        losses = mlp_sample_losses(model(x), y)
        return losses.sum() if reduction == "sum" else losses.mean()

    if warm is not None:
        wx, wy, steps = warm
        for i in range(steps):
            sl = slice(5 * i % len(wx), 5 * i % len(wx) + 5)
            opt.zero_grad()
            loss_of(wx[sl], wy[sl]).backward()
            opt.step()
    callbacks, extra = callbacks_for(model, opt)
    hm = HookManager(model, callbacks=callbacks, **(manager_kw or {}))
    thetas, pre, post, consumed, before, norms = [], [], [], [], [], []
    with hm.collect():
        for t, idx in enumerate(schedule):
            for g in opt.param_groups:
                g["lr"] = lrs[t]
            x, y = X[idx], Y[idx]
            if on_step is not None:
                with hm.paused():
                    on_step(t, model, {"x": x, "y": y})
            thetas.append(flat.of_model())
            pre.append(_flat_state(flat, opt, hyper))
            opt.zero_grad()
            loss_of(x, y).backward()
            before.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            if clip_factors is not None:
                max_norm = clip_factors[t] * float(before[-1].norm())
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                norms.append(max_norm)
            consumed.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            opt.step()
            for cb in callbacks:
                if hasattr(cb, "record_post"):
                    cb.record_post(t)
            post.append(_flat_state(flat, opt, hyper))
    hm.remove()
    thetas.append(flat.of_model())
    return Run(
        model=model,
        flat=flat,
        hyper=hyper,
        X=X,
        Y=Y,
        XQ=XQ,
        YQ=YQ,
        schedule=schedule,
        lrs=list(lrs),
        reduction=reduction,
        thetas=thetas,
        pre=pre,
        post=post,
        consumed=consumed,
        grad_before_clip=before,
        max_norms=norms if clip_factors is not None else None,
        ids=hash_batch({"input_ids": X}),
        qids=hash_batch({"input_ids": XQ}),
        extra=extra,
    )


def capture_queries(model: nn.Module, store, XQ: torch.Tensor, YQ: torch.Tensor, **kw) -> None:
    """Raw per-sample query gradients (sum loss) at the model's current weights."""
    from dattri_llm import HookManager, OffloadCallback

    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)], **kw)
    with hm.collect():
        mlp_sample_losses(model(XQ), YQ).sum().backward()
    hm.remove()
    model.zero_grad()


def query_grads(run: Run) -> torch.Tensor:
    """``(Q, P)`` raw query gradients at θ_T."""
    return run.flat.sample_grads(run.thetas[-1], run.XQ, run.YQ)


def shares(run: Run, t: int) -> torch.Tensor:
    """``(B, P)`` each sample's share of step ``t``'s batch loss at θ_t."""
    idx = run.schedule[t]
    s = run.flat.sample_grads(run.thetas[t], run.X[idx], run.Y[idx])
    return s / len(idx) if run.reduction == "mean" else s


def removal(run: Run, S: torch.Tensor) -> torch.Tensor:
    """The batch-gradient change of removing each sample from its step, as a push direction.

    Sum loss: the share ``s``. Mean loss: the mean is re-taken over the ``B − 1`` others, so
    the batch gradient changes by ``(G − B s)/(B − 1)``: the direction is ``(B s − G)/(B − 1)``
    with ``G = Σ s`` (exact at fixed θ).
    """
    if run.reduction == "sum":
        return S
    b = S.shape[0]
    return (b * S - S.sum(0)) / (b - 1)


def kappa(run: Run, t: int) -> float:
    return float(len(run.schedule[t])) if run.reduction == "mean" else 1.0


# ---- exact derivative and leave-one-out: the training loop unrolled explicitly -------------------
def unrolled_final(run: Run, w: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """θ_T of the captured window re-run functionally with per-sample loss weights ``w`` (N,).

    Reproduces the real run at ``w = 1`` (checked in the tests); differentiable in ``w`` with
    ``create_graph=True`` (the true Hessian enters through the double backward).
    """
    h, flat = run.hyper, run.flat
    theta = run.thetas[0].clone().requires_grad_(True)
    st = run.pre[0]
    if h.kind == "adam":
        m, v = st["m"].clone(), st["v"].clone()
        vmax = st["vmax"].clone() if h.amsgrad else None
        count = st["count"]
    else:
        buf = None if st["buf"] is None else st["buf"].clone()
    for t, idx in enumerate(run.schedule):
        losses = flat.losses(theta, run.X[idx], run.Y[idx]) * w[idx]
        loss = losses.sum() if run.reduction == "sum" else losses.mean()
        g = torch.autograd.grad(loss, theta, create_graph=create_graph)[0]
        if run.max_norms is not None:
            g = g * clip_coef(g, run.max_norms[t])
        lr = run.lrs[t]
        if h.kind == "adam":
            count += 1
            theta, m, v, vmax = adam_step(theta, m, v, vmax, g, count, h, lr)
        else:
            theta, buf = sgd_step(theta, buf, g, h, lr)
        if not create_graph:
            theta = theta.detach().requires_grad_(True)
            if h.kind == "adam":
                m, v = m.detach(), v.detach()
                vmax = vmax.detach() if vmax is not None else None
            elif buf is not None:
                buf = buf.detach()
    return theta


def exact_scores(run: Run) -> torch.Tensor:
    """``(N, Q)``: −∂ℓ_q(θ_T)/∂w_z by autograd through the unrolled run (removal sign)."""
    n = run.X.shape[0]
    w = torch.ones(n, dtype=DT, requires_grad=True)
    theta = unrolled_final(run, w, create_graph=True)
    ql = run.flat.losses(theta, run.XQ, run.YQ)
    cols = [-torch.autograd.grad(ql[j], w, retain_graph=True)[0] for j in range(len(ql))]
    return torch.stack(cols, dim=1).detach()


def loo_scores(run: Run) -> torch.Tensor:
    """``(N, Q)``: the actual change of each query's loss when sample z is left out."""
    n = run.X.shape[0]
    base = run.flat.losses(run.thetas[-1], run.XQ, run.YQ).detach()
    rows = []
    for z in range(n):
        w = torch.ones(n, dtype=DT)
        w[z] = 0.0
        theta = unrolled_final(run, w, create_graph=False)
        rows.append(run.flat.losses(theta.detach(), run.XQ, run.YQ).detach() - base)
    return torch.stack(rows)


# ---- explicit linearised optimizer steps (dense matrices) ----------------------------------------
def clip_jacobian(run: Run, t: int, coords: torch.Tensor | None = None) -> torch.Tensor:
    """∂(clipped g)/∂G of ``clip_grad_norm_``: c (I − G Gᵀ / (‖G‖ (‖G‖ + 1e-6))) (I unclipped)."""
    G = run.grad_before_clip[t]
    P = G.numel() if coords is None else coords.numel()
    if run.max_norms is None:
        return torch.eye(P, dtype=DT)
    norm = G.norm()
    c = min(1.0, run.max_norms[t] / float(norm + 1e-6))
    if c >= 1.0:
        return torch.eye(P, dtype=DT)
    full = c * (torch.eye(G.numel(), dtype=DT) - torch.outer(G, G) / (norm * (norm + 1e-6)))
    return full if coords is None else full[coords][:, coords]


def adam_step_matrices(
    run: Run, t: int, coords: torch.Tensor | None = None, curvature: bool = True
):
    """``(J, D)`` of step ``t``: δx_{t+1} = J δx_t for carried perturbations and
    δx_{t+1} = D δg for a change δg of the consumed gradient; x = [θ, m, v(, v_max)].

    Written out by hand from torch's Adam/AdamW update, with the step's empirical Fisher
    ``κ Σ s sᵀ`` as the curvature (restricted to ``coords`` when given).
    """
    h = run.hyper
    sel = (lambda x: x) if coords is None else (lambda x: x[..., coords])
    S = sel(shares(run, t))
    P = S.shape[1]
    I, Z = torch.eye(P, dtype=DT), torch.zeros(P, P, dtype=DT)
    lr = run.lrs[t]
    pre = run.pre[t]
    c = pre["count"] + 1
    theta = sel(run.thetas[t])
    lam_c = h.weight_decay if not h.decoupled else 0.0
    lam_d = h.weight_decay if h.decoupled else 0.0
    g = sel(run.consumed[t]) + lam_c * theta  # what Adam's update reads
    m1 = h.beta1 * sel(pre["m"]) + (1 - h.beta1) * g
    v1 = h.beta2 * sel(pre["v"]) + (1 - h.beta2) * g * g
    if h.amsgrad:
        vmax0 = sel(pre["vmax"])
        won = (v1 >= vmax0).to(DT)
        u = torch.maximum(vmax0, v1)
    else:
        u = v1
    bc1, bc2 = 1 - h.beta1**c, 1 - h.beta2**c
    r = (u / bc2).sqrt()
    den = r + h.eps
    a = lr / (bc1 * den)
    b = torch.where(r > 0, lr * (m1 / bc1) / (den * den * 2 * r.clamp_min(1e-300) * bc2), 0.0)
    H = kappa(run, t) * S.T @ S if curvature else torch.zeros(P, P, dtype=DT)
    Jc = clip_jacobian(run, t, coords)
    Jg = Jc @ H + lam_c * I  # ∂g/∂θ
    nb = 4 if h.amsgrad else 3

    def row(*blocks):
        return torch.cat(list(blocks) + [Z] * (nb - len(blocks)), dim=1)

    Mm = row((1 - h.beta1) * Jg, h.beta1 * I)
    Mv = row(2 * (1 - h.beta2) * torch.diag(g) @ Jg, Z, h.beta2 * I)
    if h.amsgrad:
        Mu = torch.diag(won) @ Mv + torch.diag(1 - won) @ row(Z, Z, Z, I)
    else:
        Mu = Mv
    Mt = (1 - lr * lam_d) * row(I) - torch.diag(a) @ Mm + torch.diag(b) @ Mu
    J = torch.cat([Mt, Mm, Mv] + ([Mu] if h.amsgrad else []), dim=0)
    dm = (1 - h.beta1) * I
    dv = 2 * (1 - h.beta2) * torch.diag(g)
    du = torch.diag(won) @ dv if h.amsgrad else dv
    dt = -torch.diag(a) @ dm + torch.diag(b) @ du
    D = torch.cat([dt, dm, dv] + ([du] if h.amsgrad else []), dim=0)
    return J, D, Jc, S


def sgd_step_matrices(run: Run, t: int, vectors: torch.Tensor | None = None):
    """``(J, D)`` of torch SGD's step ``t`` (x = [θ, b]), curvature ``κ Σ v vᵀ`` over ``vectors``
    (default: the step's own shares, i.e. the empirical Fisher)."""
    h = run.hyper
    S = shares(run, t)
    V = S if vectors is None else vectors
    P = S.shape[1]
    I, Z = torch.eye(P, dtype=DT), torch.zeros(P, P, dtype=DT)
    lr = run.lrs[t]
    Jg = kappa(run, t) * V.T @ V + h.weight_decay * I
    if not h.momentum:
        return I - lr * Jg, -lr * I, I, S
    first = run.pre[t]["buf"] is None
    mu, gain = h.momentum, (1.0 if first else 1 - h.dampening)
    Mb = torch.cat([gain * Jg, Z if first else mu * I], dim=1)  # δb' = μ δb + gain δg
    Db = gain * I
    if h.nesterov:  # δθ' = δθ − η (δg + μ δb')
        Mt = torch.cat([I, Z], dim=1) - lr * (torch.cat([Jg, Z], dim=1) + mu * Mb)
        Dt = -lr * (I + mu * Db)
    else:
        Mt = torch.cat([I, Z], dim=1) - lr * Mb
        Dt = -lr * Db
    return torch.cat([Mt, Mb]), torch.cat([Dt, Db]), I, S


def unroll_explicit(run: Run, step_matrices: Callable, q: torch.Tensor):
    """Scores per occurrence ``{(sample index, step): (Q,)}`` and per sample ``(N, Q)``:
    q_Tᵀ δθ_T for pushing −(clip Jacobian) s_z at the sample's step through the dense J's."""
    mats = [step_matrices(t) for t in range(len(run.schedule))]
    P = q.shape[1]
    occ = {}
    total = torch.zeros(run.X.shape[0], q.shape[0], dtype=DT)
    for t, idx in enumerate(run.schedule):
        _, D, Jc, S = mats[t]
        x = D @ (Jc @ (-removal(run, S).T))  # (nP, B): state perturbation after step t
        for k in range(t + 1, len(run.schedule)):
            x = mats[k][0] @ x
        sc = q @ x[:P]  # (Q, B)
        for i, z in enumerate(idx):
            occ[(z, t)] = sc[:, i]
            total[z] += sc[:, i]
    return occ, total


def matrix_order(model: nn.Module, layers: Sequence[str]) -> torch.Tensor:
    """Flat (``named_parameters``) index of each coordinate of the library's layout: the
    layers' matrix forms concatenated (``nn.Linear``: ``[W | b]`` row-major)."""
    offsets, o = {}, 0
    for n, p in model.named_parameters():
        offsets[n] = o
        o += p.numel()
    modules = dict(model.named_modules())
    parts = []
    for layer in layers:
        lin = modules[layer]
        assert isinstance(lin, nn.Linear)
        out, inp = lin.weight.shape
        w = offsets[f"{layer}.weight"] + torch.arange(out * inp).reshape(out, inp)
        cols = [w]
        if lin.bias is not None:
            cols.append((offsets[f"{layer}.bias"] + torch.arange(out)).reshape(out, 1))
        parts.append(torch.cat(cols, dim=1).reshape(-1))
    return torch.cat(parts)
