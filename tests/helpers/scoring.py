"""The tiny language model and store capture of the scoring-at-scale tests."""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    OffloadCallback,
)

V, T = 11, 4


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 5)
        self.fc = nn.Linear(5, 7)
        self.head = nn.Linear(7, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(input_ids))))


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )


def make_model(seed: int = 0) -> LM:
    torch.manual_seed(seed)
    return LM().double()


def samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (T,), generator=g)} for _ in range(n)]


def capture(model: nn.Module, store: GradientStorageManager, data: list[dict], bs: int, ckpt=0):
    # factors kept: EK-FAC fits its covariances from these stores
    hm = HookManager(
        model, callbacks=[OffloadCallback(file_manager=store, keep_token_factors=True)]
    )
    hm.checkpoint = ckpt
    with hm.collect():
        for i in range(0, len(data), bs):
            batch = {"input_ids": torch.stack([d["input_ids"] for d in data[i : i + bs]])}
            model.zero_grad()
            lm_loss(model, batch).backward()
    hm.remove()
    store.close()
