"""``GradientIndex`` end to end on a store: build, then ``search`` (test store read, compatibility
check, proponents and opponents, the AttributionScore) vs one raw search direction.

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/benchmark/index_e2e.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from dattri_llm import GradientIndex, GradientStorageManager
from dattri_llm.attribution.index.kinds import import_faiss
from dattri_llm.gradient import Gradient, GradientRecord, Materialized
from experiments.benchmark.index import data


def layer(a) -> Materialized:
    d = a.shape[1]
    return Materialized(torch.from_numpy(a), "projected.mask", {"_d": d, "proj_dim": d, "seed": 0})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--queries", type=int, default=100)
    a = ap.parse_args()
    faiss = import_faiss()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    x, q = data(a.n, a.queries, a.dim, 512, 3.0, 0)
    root = Path(tempfile.mkdtemp())
    with GradientStorageManager(root / "train", fsync=False) as store:
        for i in range(0, a.n, 500):
            hashes = [f"t{j}" for j in range(i, min(i + 500, a.n))]
            store.write(GradientRecord(i, hashes, Gradient({"l": layer(x[i : i + 500])})))
    with GradientStorageManager(root / "test", fsync=False) as store:
        hashes = [f"q{j}" for j in range(a.queries)]
        store.write(GradientRecord(0, hashes, Gradient({"l": layer(q)})))
    print(f"N={a.n} D={a.dim} Q={a.queries}")
    for kind in ("flat", "hnsw"):
        t = time.perf_counter()
        GradientIndex.build(root / "train", root / kind, "cosine", kind)
        build = time.perf_counter() - t
        index = GradientIndex.open(root / kind)
        index.search(root / "test", k=10)  # warm-up
        t = time.perf_counter()
        index.search(root / "test", k=10)
        full = time.perf_counter() - t
        t = time.perf_counter()
        if kind == "flat":
            (torch.from_numpy(q) @ torch.from_numpy(x).T).topk(10, dim=1)
        else:
            index._parts[0][0].search(q, 10)
        raw = time.perf_counter() - t
        print(
            f"{kind}: build {build:.1f} s; search() {1e3 * full / a.queries:.3f} ms/query; "
            f"one raw direction {1e3 * raw / a.queries:.3f} ms/query"
        )


if __name__ == "__main__":
    main()
