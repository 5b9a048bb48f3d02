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
