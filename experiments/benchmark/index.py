"""Nearest-neighbour search over projected gradient vectors: exact torch top-k vs FAISS kinds.

N synthetic "gradient-like" vectors (a mixture of weakly separated clusters with log-normal
norms: vectors that cluster poorly, as projected gradients do) and Q queries from the same
mixture, cosine metric (Grad-Cos: unit vectors, inner products). For each setting: build time,
index size, search time per query (a batch of Q queries, one thread), recall@10 of the
proponents against the exact top-10, and the speed-up per query over the exact torch matmul
top-k. The FAISS indexes are built with the library's own constructor
(``dattri_llm.attribution.index.kinds.make_index``), the one ``GradientIndex.build`` uses.

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/benchmark/index.py --n 100000 --dim 1024
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from dattri_llm.attribution.index.kinds import import_faiss, make_index, set_search_params
from dattri_llm.attribution.index.part_search import exact_rerank


def data(
    n: int, q: int, dim: int, clusters: int, noise: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, dim), dtype=np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)

    def draw(m: int) -> np.ndarray:
        which = rng.integers(0, clusters, m)
        x = centers[which] + noise / np.sqrt(dim) * rng.standard_normal((m, dim), dtype=np.float32)
        x *= rng.lognormal(0.0, 1.0, (m, 1)).astype(np.float32)  # gradient norms vary a lot
        return x / np.linalg.norm(x, axis=1, keepdims=True)  # cosine: unit vectors

    return np.ascontiguousarray(draw(n)), np.ascontiguousarray(draw(q))


def timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def index_bytes(faiss, index) -> int:
    with tempfile.NamedTemporaryFile(suffix=".faiss") as f:
        faiss.write_index(index, f.name)
        return os.path.getsize(f.name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--clusters", type=int, default=512)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--noise", type=float, default=3.0, help="noise norm / center norm")
    ap.add_argument("--skip", nargs="*", default=[], help="settings to skip: ivf ivfpq hnsw")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--hnsw-m", type=int, default=16)
    ap.add_argument("--ef-construction", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="N=20000, D=256, 50 queries")
    a = ap.parse_args()
    if a.quick:
        a.n, a.dim, a.queries = 20_000, 256, 50
    torch.set_num_threads(1)
    faiss = import_faiss()
    faiss.omp_set_num_threads(1)
    x, q = data(a.n, a.queries, a.dim, a.clusters, a.noise, 0)
    k = a.k
    print(
        f"N={a.n} D={a.dim} Q={a.queries} k={k} clusters={a.clusters} noise={a.noise} "
        f"faiss {faiss.__version__}"
    )
    xt, qt = torch.from_numpy(x), torch.from_numpy(q)
    t_exact, (_, exact) = timed(lambda: (qt @ xt.T).topk(k, dim=1), repeat=3)
    exact = exact.numpy()
    per_exact = t_exact / a.queries
    rows = [
        {
            "setting": "torch matmul + topk (exact)",
            "build_s": 0.0,
            "bytes": x.nbytes,
            "ms_per_query": 1e3 * per_exact,
            "recall": 1.0,
        }
    ]

    def measure(name: str, index, kind: str, params: dict, build_s: float, size: int) -> None:
        set_search_params(index, kind, params)
        if params.get("pq_m") is None:
            t, (_, ids) = timed(lambda: index.search(q, k), repeat=2)
        else:  # the PQ short list re-ranked exactly, as GradientIndex does from its file
            t, (_, ids) = timed(
                lambda: exact_rerank(x, q, index.search(q, params["rerank"] * k)[1], k), repeat=2
            )
            ids = ids.numpy()
        recall = np.mean([len(set(ids[i]) & set(exact[i])) / k for i in range(a.queries)])
        ms = 1e3 * t / a.queries
        rows.append({"setting": name, "build_s": build_s, "bytes": size, "ms_per_query": ms})
        rows[-1]["recall"] = float(recall)
        r = rows[-1]
        print(
            f"{name:44s} build {build_s:7.1f} s  {size / 2**20:8.1f} MiB  "
            f"{r['ms_per_query']:8.3f} ms/query  recall@{k} {recall:.3f}  "
            f"x{per_exact * 1e3 / r['ms_per_query']:.1f}",
            flush=True,
        )

    print(f"{'torch exact':44s} {1e3 * per_exact:.3f} ms/query", flush=True)
    b, flat = timed(lambda: make_index("flat", a.dim, {}, x))
    measure("faiss flat (exact)", flat, "flat", {}, b, index_bytes(faiss, flat))
    del flat
    nlist = int(4 * np.sqrt(a.n))
    if "ivf" not in a.skip:
        p = {"nlist": nlist, "nprobe": 1, "train_size": min(a.n, 32 * nlist), "seed": 0}
        p |= {"pq_m": None, "pq_bits": 8, "rerank": 4}
        b, ivf = timed(lambda: make_index("ivf", a.dim, p, x))
        size = index_bytes(faiss, ivf)
        for nprobe in (4, 16, 32, 64, 128):
            measure(f"ivf-flat nlist={nlist} nprobe={nprobe}", ivf, "ivf", {**p, "nprobe": nprobe},
                    b, size)  # fmt: skip
        del ivf
    if "ivfpq" not in a.skip:
        m = max(d for d in (64, 32, 16, 8) if a.dim % d == 0 and a.dim // d >= 16)
        p = {"nlist": nlist, "nprobe": 1, "train_size": min(a.n, 32 * nlist), "seed": 0}
        p |= {"pq_m": m, "pq_bits": 8, "rerank": 4}
        b, pq = timed(lambda: make_index("ivf", a.dim, p, x))
        size = index_bytes(faiss, pq)
        for nprobe, rerank in ((16, 10), (32, 10), (64, 10), (64, 20)):
            measure(f"ivf-pq m={m} nprobe={nprobe} rerank={rerank}k", pq, "ivf",
                    {**p, "nprobe": nprobe, "rerank": rerank}, b, size)  # fmt: skip
        del pq
    if "hnsw" not in a.skip:
        p = {"M": a.hnsw_m, "efConstruction": a.ef_construction, "efSearch": 16}
        b, hnsw = timed(lambda: make_index("hnsw", a.dim, p, x))
        size = index_bytes(faiss, hnsw)
        for ef in (16, 32, 64, 128, 256):
            name = f"hnsw M={a.hnsw_m} efC={a.ef_construction} efSearch={ef}"
            measure(name, hnsw, "hnsw", {**p, "efSearch": ef}, b, size)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
