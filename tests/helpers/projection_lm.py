"""The tiny language model of the end-to-end projection tests."""

from __future__ import annotations

import torch
from torch import nn

V, T = 17, 6


class LM(nn.Module):
    """Embedding -> linear -> LayerNorm -> linear head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 5)
        self.fc = nn.Linear(5, 7)
        self.ln = nn.LayerNorm(7)
        self.head = nn.Linear(7, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over samples of the summed next-token cross-entropy."""
    ids = batch["input_ids"]
    logits = model(ids)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )
