"""K-FAC / EK-FAC oracles (``torch.kron`` + dense solves) and the small model they run on.

Shared by the Kronecker, Kronecker-attributor, TrackStar and second-moment Fisher tests.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dattri_llm import (
    AttributionArguments,
    HookManager,
    HookManagerConfig,
    OptimizerStateCallback,
)


def matrix_form(grads: dict, weight: str, bias: str | None, transpose: bool = False):
    """Oracle per-sample gradients in the ``[W | b]`` ``(K, D)`` row-major form, ``(B, K*D)``."""
    w = grads[weight]
    w = w.transpose(1, 2) if transpose else w.reshape(w.shape[0], w.shape[1], -1)
    if bias is not None:
        w = torch.cat([w, grads[bias].unsqueeze(-1)], dim=-1)
    return w.reshape(w.shape[0], -1)


def io_oracle(model, loss_fn, rows, module, unfold=None):
    """Per-sample (a with ones column, g) of ``module``, one sample at a time, plain hooks."""
    store = {}

    def fwd(mod, args, out):
        store["x"] = args[0].detach()
        out.retain_grad()
        store["out"] = out

    h = module.register_forward_hook(fwd)
    pairs = []
    for row in rows:
        model.zero_grad()
        loss_fn(model, row).backward()
        x, go = store["x"], store["out"].grad.detach()
        if unfold is not None:
            a, g = unfold(x), go.flatten(2).transpose(1, 2)[0]
        else:
            a, g = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
        if getattr(module, "bias", None) is not None:
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        pairs.append((a, g))
    h.remove()
    return pairs


def kfac_ag(pairs, token_mask=None):
    """Oracle A (mean over counted tokens) and G (mean over samples of per-sample sums)."""
    a_sum, g_sum, n_tok = 0, 0, 0
    for i, (a, g) in enumerate(pairs):
        keep = slice(None) if token_mask is None else token_mask[i]
        a_sum = a_sum + a[keep].T @ a[keep]
        g_sum = g_sum + g.T @ g
        n_tok += a[keep].shape[0]
    return a_sum / n_tok, g_sum / len(pairs)


def dense_scores(fisher: torch.Tensor, test: torch.Tensor, train: torch.Tensor, lam: float):
    """``test (F + lam I)^{-1} train^T`` by a dense solve: ``(n_test, n_train)``."""
    p = fisher.shape[0]
    sol = torch.linalg.solve(fisher + lam * torch.eye(p, dtype=fisher.dtype), train.T)
    return test @ sol


def ekfac_fisher(a_mat, g_mat, train_dense):
    """Explicit EK-FAC matrix: ``Q diag(mean_n (Q^T m_n)^2) Q^T``, ``Q = Q_G ⊗ Q_A``."""
    q = torch.kron(torch.linalg.eigh(g_mat)[1], torch.linalg.eigh(a_mat)[1])
    lam = ((train_dense @ q) ** 2).mean(0)
    return q @ torch.diag(lam) @ q.T


V, T = 11, 5


LAYERS = {"fc": "fc.bias", "head": None}


CONFIG = HookManagerConfig(linear_io=["fc", "head"])


class SeqMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, V, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.fc(self.emb(input_ids)))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )


def make_model() -> SeqMLP:
    torch.manual_seed(0)
    return SeqMLP().double()


def dataset(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (T,), generator=g)} for _ in range(n)]


def run_args(tmp_path, **kw) -> AttributionArguments:
    kw.setdefault("per_device_train_batch_size", 3)
    kw.setdefault("per_device_eval_batch_size", 2)
    kw.setdefault("show_progress", False)
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw)


def vmap_grads(model: nn.Module, ds: list[dict]) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, ids: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (ids[None],))
        return nn.functional.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")

    return vmap(grad(one), in_dims=(None, 0))(params, torch.stack([d["input_ids"] for d in ds]))


class Oracle:
    """Explicit K-FAC / EK-FAC matrices of the fc and head layers (last position: no gradient)."""

    def __init__(self, model: nn.Module, train: list[dict], test: list[dict]) -> None:
        rows = [{"input_ids": d["input_ids"][None]} for d in train]
        ps, pt = vmap_grads(model, train), vmap_grads(model, test)
        mask = [torch.arange(T) < T - 1] * len(train)
        self.layers = {}
        for name, bias in LAYERS.items():
            pairs = io_oracle(model, loss_fn, rows, getattr(model, name))
            a, g = kfac_ag(pairs, token_mask=mask)
            tr, te = (
                matrix_form(ps, f"{name}.weight", bias),
                matrix_form(pt, f"{name}.weight", bias),
            )
            self.layers[name] = (a, g, tr, te, pairs)

    def fisher(self, name: str, kind: str) -> torch.Tensor:
        a, g, tr, _, _ = self.layers[name]
        return torch.kron(g, a) if kind == "kfac" else ekfac_fisher(a, g, tr)

    def scores(self, kind: str, lam: float) -> torch.Tensor:
        """``(n_train, n_test)``."""
        out = 0
        for name, (_, _, tr, te, _) in self.layers.items():
            out = out + dense_scores(self.fisher(name, kind), te, tr, lam).T
        return out

    def token_scores(self, kind: str, lam: float, i: int) -> torch.Tensor:
        """``(T, n_test)`` contributions of train sample ``i``'s positions."""
        out = 0
        for name, (_, _, _, te, pairs) in self.layers.items():
            fisher = self.fisher(name, kind)
            pre = torch.linalg.solve(
                fisher + lam * torch.eye(len(fisher), dtype=fisher.dtype), te.T
            )  # (P, M)
            a, g = pairs[i]
            per_tok = (g[:, :, None] * a[:, None, :]).reshape(a.shape[0], -1)  # (T, P)
            out = out + per_tok @ pre
        return out


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


def offload(model, ds, path, callbacks=(), batch=3, config=CONFIG, checkpoint=0, mode="create"):
    from dattri_llm import GradientStorageManager, OffloadCallback

    fm = GradientStorageManager(str(path), mode=mode)
    # K-FAC fits its covariances from the store's factors: keep them (compact storage drops them)
    off = OffloadCallback(file_manager=fm, keep_token_factors=True)
    hm = HookManager(model, config, callbacks=[off, *callbacks])
    hm.checkpoint = checkpoint
    with hm.collect():
        for i in range(0, len(ds), batch):
            ids = torch.stack([d["input_ids"] for d in ds[i : i + batch]])
            model.zero_grad()
            loss_fn(model, {"input_ids": ids}).backward()
    hm.remove()
    fm.close()
    return str(path)


def adam_run(model, steps: int = 3):
    """A few AdamW steps on random data, recorded by OptimizerStateCallback."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rec = OptimizerStateCallback(model, opt)
    hm = HookManager(model, CONFIG, callbacks=[rec])
    data = dataset(4 * steps, 7)
    with hm.collect():
        for s in range(steps):
            ids = torch.stack([d["input_ids"] for d in data[4 * s : 4 * s + 4]])
            opt.zero_grad()
            loss_fn(model, {"input_ids": ids}).backward()
            opt.step()
            rec.record_post(s)
    return opt, rec, hm
