"""Small gradient stores and models for the store tests: toy records, written stores, a net."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dattri_llm import AttributionArguments, GradientStorageManager
from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    Materialized,
    Shared,
)
from dattri_llm.gradient.store.format import write_meta
from dattri_llm.gradient.store.writer import PartitionWriter

V, E = 11, 4


class Net(nn.Module):
    """Embedding -> Linear -> LayerNorm -> Conv1d (over tokens) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.fc = nn.Linear(E, 6)
        self.ln = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 3, kernel_size=3, padding=1)
        self.out = nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.fc(self.emb(ids))))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h))


def args(tmp_path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


def assert_same_gradient(g1: Gradient, g2: Gradient) -> None:
    assert g1.layer_names == g2.layer_names
    for name in g1.layer_names:
        l1, l2 = g1.layers[name], g2.layers[name]
        assert type(l1) is type(l2), name
        leaves1 = l1.sites if isinstance(l1, Shared) else [l1]
        leaves2 = l2.sites if isinstance(l2, Shared) else [l2]
        if isinstance(l1, Shared):
            assert l1.site_names == l2.site_names
        for a, b in zip(leaves1, leaves2, strict=True):
            assert type(a) is type(b)
            assert a.layer_type == b.layer_type
            assert a.module_kwargs == b.module_kwargs
            pairs = [(a.a, b.a), (a.g, b.g)] if isinstance(a, Factorized) else [(a.data, b.data)]
            for t1, t2 in pairs:
                assert t1.dtype == t2.dtype and t1.shape == t2.shape
                assert torch.equal(t1, t2), name


def toy_record(step: int, n: int = 3, seed: int | None = None, hashes=None) -> GradientRecord:
    gen = torch.Generator().manual_seed(step if seed is None else seed)
    lin = Factorized(
        torch.randn(n, 4, 5, generator=gen, dtype=torch.float64),
        torch.randn(n, 4, 3, generator=gen, dtype=torch.float64),
        "nn.Linear",
        {"in_features": 4, "out_features": 3, "bias": True, "_k": 3, "_d": 5},
    )
    dense = Materialized(
        torch.randn(n, 6, generator=gen, dtype=torch.float64),
        "nn.LayerNorm",
        {"normalized_shape": [3], "eps": 1e-5, "weight": True, "bias": True},
    )
    hashes = hashes or [f"s{step}-{i}" for i in range(n)]
    return GradientRecord(step, hashes, Gradient({"lin": lin, "ln": dense}), checkpoint=step % 2)


def write_store(path: Path, steps=(0, 1, 2, 3), **kw) -> list:
    records = [toy_record(s) for s in steps]
    with GradientStorageManager(path, **kw) as store:
        for r in records:
            store.write(r)
    return records


def write_ranks(root: Path, per_rank: int = 2) -> None:
    """Two rank partitions, as two ``torch.distributed`` ranks write them."""
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    for r in (0, 1):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 2}, lambda e: None)
        for s in range(per_rank):
            w.write(toy_record(s, hashes=[f"r{r}-{s}-{i}" for i in range(3)]))
        w.close()


def capture_to_store(model, data, store, cfg=None, checkpoint=0, **offload) -> list:
    """Write ``data`` (one backward of ``(model(x) ** 2).sum()`` per batch) to ``store``.

    ``store``: a ``GradientStorageManager`` or a path; ``offload``: ``OffloadCallback``
    options. Returns the captured records (in memory, as the store received them).
    """
    from dattri_llm import CaptureCallback, HookManager, HookManagerConfig, OffloadCallback

    if not isinstance(store, GradientStorageManager):
        store = GradientStorageManager(store)
    cap = CaptureCallback(keep_all=True)
    off = OffloadCallback(file_manager=store, **offload)
    hm = HookManager(model, cfg or HookManagerConfig(), callbacks=[cap, off])
    hm.checkpoint = checkpoint
    with hm.collect():
        for x in data:
            model.zero_grad(set_to_none=True)
            (model(x) ** 2).sum().backward()
    hm.remove()
    return cap.records
