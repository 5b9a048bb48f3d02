"""The small MLP, data and ``vmap(grad)`` reference of the TracIn tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dattri_llm import (
    AttributionArguments,
)

V = 23


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.fc = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.fc(self.emb(input_ids)))))


def mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP().double()


def dataset(n: int, t: int = 5, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (t,), generator=g)} for _ in range(n)]


def vmap_grads(model: nn.Module, ds: list[dict]) -> torch.Tensor:
    """Brute force: (N, P) per-sample gradients by torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, ids: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, p, (ids[None],))
        return nn.functional.cross_entropy(logits[0, :-1], ids[1:], reduction="sum")

    ids = torch.stack([d["input_ids"] for d in ds])
    g = vmap(grad(one), in_dims=(None, 0))(params, ids)
    return torch.cat([g[k].reshape(len(ds), -1) for k in params], dim=1)


def args(tmp_path, **kw) -> AttributionArguments:
    kw.setdefault("per_device_train_batch_size", 3)
    kw.setdefault("per_device_eval_batch_size", 2)
    kw.setdefault("show_progress", False)
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw)
