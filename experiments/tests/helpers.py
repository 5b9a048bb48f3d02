"""Settings shared by the tests of the experiments' harnesses."""

from __future__ import annotations

import torch


def tiny_chargpt(monkeypatch):
    """The char-gpt setting on 40 random 8-char blocks (no download), 12 steps of batch 4."""
    from experiments.benchmark.quality import chargpt
    from experiments.benchmark.quality.common import TupleDataset

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 9, (2, 44, 8), generator=gen)
    blocks = (TupleDataset(x[:40], y[:40]), TupleDataset(x[40:], y[40:]), list("abcdefghi"), {})
    monkeypatch.setattr(chargpt, "make_blocks", lambda: blocks)
    monkeypatch.setattr(chargpt, "BLOCK", 8)
    hp = {**chargpt.HP, "n_layer": 1, "n_head": 2, "n_embd": 8, "steps": 12, "batch_size": 4}
    monkeypatch.setattr(chargpt, "HP", {**hp, "warmup": 3, "checkpoint_steps": [6, 12]})
    return chargpt, chargpt.make_setting("tiny-char")
