"""Peak memory of ``GradientIndex.build`` on a synthetic projected store.

Writes an ``--n`` x ``--dim`` float32 projected store once (random vectors, one layer, records
of 2048 rows, no fsync), then builds each ``--kinds`` index in a fresh child process and reports
its peak resident memory (``VmHWM``), its time and the index size. ``--code DIR`` imports
``dattri_llm`` from ``DIR`` instead (e.g. an export of an older commit, for a before/after)::

    OMP_NUM_THREADS=1 python experiments/benchmark/index_build_mem.py --n 200000 --dim 1024
    git archive 03153d9 dattri_llm | tar -x -C /tmp/old && \\
    OMP_NUM_THREADS=1 python experiments/benchmark/index_build_mem.py --code /tmp/old --reuse
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def write_store(path: Path, n: int, dim: int, batch: int = 2048) -> float:
    import torch

    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient import Gradient, GradientRecord, Materialized

    kw = {"_d": dim, "proj_dim": dim, "seed": 0, "source_layer_type": "nn.Linear"}
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with GradientStorageManager(path, fsync=False) as store:
        for step, lo in enumerate(range(0, n, batch)):
            b = min(batch, n - lo)
            x = torch.randn(b, dim, generator=g)
            grad = Gradient({"l": Materialized(x, "projected.mask", kw)})
            store.write(GradientRecord(step, [f"s{j}" for j in range(lo, lo + b)], grad))
    return time.perf_counter() - t0


def child(store: str, out: str, kind: str, block_rows: int | None) -> None:
    import faiss
    import torch

    from dattri_llm import GradientIndex

    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    extra = {"block_rows": block_rows} if block_rows else {}
    params = {"nlist": 256} if kind == "ivf" else {}
    t0 = time.perf_counter()
    c0 = time.process_time()
    index = GradientIndex.build(store, out, "dot", kind, overwrite=True, **extra, **params)
    row = {
        "kind": kind,
        "block_rows": block_rows,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_s": round(time.process_time() - c0, 1),
        "index_bytes": sum(p["bytes"] for p in index.meta["parts"]),
    }
    with open("/proc/self/status", encoding="ascii") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    row["peak_rss_mb"] = round(hwm / 1024)
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--root", default="/tmp/index_build_mem")
    ap.add_argument("--kinds", nargs="+", default=["flat", "ivf"])
    ap.add_argument("--block-rows", type=int, default=None, help="None: the default")
    ap.add_argument("--code", help="import dattri_llm from here (an older commit's export)")
    ap.add_argument("--reuse", action="store_true", help="keep an existing store")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.child[2], a.block_rows)
    root = Path(a.root)
    store = root / f"store_{a.n}x{a.dim}"
    if not (a.reuse and store.exists()):
        import shutil

        shutil.rmtree(store, ignore_errors=True)
        s = write_store(store, a.n, a.dim)
        print(f"store {store}: {a.n} x {a.dim} float32 written in {s:.0f} s", file=sys.stderr)
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([a.code or here, here])
    vec_mb = a.n * a.dim * 4 / 2**20
    for kind in a.kinds:
        cmd = [sys.executable, __file__, "--child", str(store), str(root / f"idx_{kind}"), kind]
        if a.block_rows:
            cmd += ["--block-rows", str(a.block_rows)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["code"] = a.code or "this tree"
        row["vectors_mb"] = round(vec_mb)
        row["peak_over_vectors"] = round(row["peak_rss_mb"] / vec_mb, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
