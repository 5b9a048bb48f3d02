"""The small model two gloo ranks capture, shared by the distributed-store and FSDP tests."""

from __future__ import annotations

import torch
from torch import nn

N, T, B = 8, 5, 2  # samples, tokens, per-rank batch size


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 6)
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def make():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    model = Net()
    ids = torch.randint(0, 17, (N, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["input_ids"]) ** 2).sum()
