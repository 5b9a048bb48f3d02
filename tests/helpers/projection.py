"""The small net, batches and projection matrices of the capture-time projection tests."""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Gradient

B1, B2, T, V = 4, 3, 7, 13


class Net(nn.Module):
    """Embedding, linear, LayerNorm, Conv1d over tokens, RMSNorm, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 5, 3, padding=1)
        self.rms = nn.RMSNorm(5)
        self.head = nn.Linear(5, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.fc(self.emb(input_ids))))
        h = torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(self.rms(h))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["input_ids"]) - batch["y"]) ** 2).sum()


def make_batch(b: int) -> dict:
    return {"input_ids": torch.randint(0, V, (b, T)), "y": torch.randn(b, T, 3)}


def matrix_forms(ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each layer's per-sample matrix form ``(B, K, D)`` (weight shape, bias as last column)."""

    def wb(name: str) -> torch.Tensor:
        w = ref[f"{name}.weight"]
        return torch.cat(
            [w.reshape(w.shape[0], w.shape[1], -1), ref[f"{name}.bias"][..., None]], -1
        )

    return {
        "emb": ref["emb.weight"],
        "fc": wb("fc"),
        "ln": torch.stack([ref["ln.weight"], ref["ln.bias"]], 1),
        "conv": wb("conv"),
        "rms": ref["rms.weight"][:, None, :],
        "head": wb("head"),
    }


def capture(model: nn.Module, batch: dict, config: HookManagerConfig, callbacks=()) -> Gradient:
    cb = CaptureCallback()
    hm = HookManager(model, config=config, callbacks=[cb, *callbacks])
    with hm.collect(deregister_on_exit=True):
        loss_fn(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return cb.pop().gradient


def net() -> Net:
    torch.manual_seed(0)
    return Net().double()
