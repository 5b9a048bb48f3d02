"""Small vector stores for the gradient-index tests (``faiss`` skipped where missing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dattri_llm import GradientStorageManager
from dattri_llm.attribution.index import (
    GradientIndex,
)
from dattri_llm.gradient import Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store.format import write_meta
from dattri_llm.gradient.store.writer import PartitionWriter

DIMS = {"fc1": 12, "fc2": 20}


def layer(data: torch.Tensor, seed: int = 3) -> Materialized:
    d = data.shape[1]
    kw = {"_d": d, "proj_dim": d, "seed": seed, "source_layer_type": "nn.Linear"}
    return Materialized(data, "projected.mask", kw)


def record(step, vectors, hashes, checkpoint=0, seed=3) -> GradientRecord:
    """One record whose layers split ``vectors`` (B, 32) in DIMS order."""
    parts = torch.split(vectors, list(DIMS.values()), dim=1)
    grad = Gradient({n: layer(p.contiguous(), seed) for n, p in zip(DIMS, parts)})
    return GradientRecord(step, list(hashes), grad, checkpoint)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def train_vectors(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, sum(DIMS.values()), generator=gen(seed), dtype=torch.float64)


def write(path: Path, vectors: torch.Tensor, prefix: str = "t", batch: int = 8, seed: int = 3):
    with GradientStorageManager(path) as store:
        for s, i in enumerate(range(0, len(vectors), batch)):
            hashes = [f"{prefix}{j}" for j in range(i, min(i + batch, len(vectors)))]
            store.write(record(s, vectors[i : i + batch], hashes, seed=seed))


def clustered(n: int, centers: int, dim: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    c = torch.randn(centers, dim, generator=g, dtype=torch.float64) * 3
    which = torch.randint(0, centers, (n,), generator=g)
    return c[which] + 0.5 * torch.randn(n, dim, generator=g, dtype=torch.float64)


faiss = pytest.importorskip("faiss")


def two_rank_store(root: Path) -> None:
    """Two partitions, 3 steps each; rank 1 repeats some of rank 0's samples (summed)."""
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    vecs = train_vectors(480, seed=4)
    for r in (0, 1):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 2}, lambda e: None)
        for s in range(3):
            lo = r * 240 + s * 80
            ids = [f"t{i}" for i in range(lo, lo + 80)]
            if r == 1 and s == 2:
                ids[:30] = [f"t{i}" for i in range(30)]  # rows of rank 0's samples
            w.write(record(s, vecs[lo : lo + 80], ids))
        w.close()


def faiss_bytes(index: GradientIndex) -> list[bytes]:
    """The parts' FAISS bytes; for ``hnsw`` its stored vectors only (FAISS inserts a batch's
    vectors by decreasing graph level, so the graph depends on the blocks, not the vectors)."""
    out = []
    for part in index._parts:
        x = part[0]
        if index.kind == "hnsw":
            flat = faiss.downcast_index(faiss.downcast_index(x).storage)
            x = faiss.IndexFlatIP(flat.d)
            x.add(faiss.rev_swig_ptr(flat.get_xb(), flat.ntotal * flat.d).reshape(-1, flat.d))
        out.append(bytes(faiss.serialize_index(x)))
    return out
