"""Opening a large gradient store: the binary sample index vs the JSONL index.

A synthetic store of ``--n`` samples (records of ``--batch``, SHA-256 ids, one tiny layer:
opening reads no tensor), opened in fresh processes, each timing ``GradientStorageManager(path)``
+ ``len`` + ``num_samples`` + ``available_checkpoints()`` and reporting the resident memory it
added and the process's peak: ``binary`` (the memory-mapped ``records.bin`` / ``samples.bin``),
``jsonl`` (the JSONL journal, as a version-1 store is read), ``lookup`` (binary, then one
``store.locations(hash)``).

    OMP_NUM_THREADS=1 python experiments/benchmark/store_open.py --n 1000000 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from utils.env import header  # noqa: E402
from utils.memory import status_bytes  # noqa: E402
from utils.table import md_table  # noqa: E402


def log(msg: str) -> None:
    print(f"[store_open] {msg}", file=sys.stderr, flush=True)


def build(path: Path, n: int, batch: int) -> float:
    import torch

    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient import Gradient, GradientRecord, Materialized

    kw = {"_d": 4, "proj_dim": 4, "seed": 0, "source_layer_type": "nn.Linear"}
    t0 = time.perf_counter()
    with GradientStorageManager(path, fsync=False) as store:
        for step, lo in enumerate(range(0, n, batch)):
            b = min(batch, n - lo)
            ids = [hashlib.sha256(str(j).encode()).hexdigest() for j in range(lo, lo + b)]
            grad = Gradient({"l": Materialized(torch.zeros(b, 4), "projected.mask", kw)})
            store.write(GradientRecord(step, ids, grad, step % 2))
    return time.perf_counter() - t0


def child(path: str, mode: str) -> None:
    from dattri_llm.gradient.store import manager
    from dattri_llm.gradient.store.manager import GradientStorageManager

    if mode == "jsonl":
        manager.uses_binary_index = lambda meta: False
    before = status_bytes("VmRSS")
    t0 = time.perf_counter()
    store = GradientStorageManager(path)
    facts = (len(store), store.num_samples, store.available_checkpoints())
    wall = time.perf_counter() - t0
    extra = {}
    if mode == "lookup":
        t1 = time.perf_counter()
        hit = store.locations(hashlib.sha256(b"12345").hexdigest())
        extra = {"lookup_s": time.perf_counter() - t1, "found": len(hit)}
    rss_mb = (status_bytes("VmRSS") - before) / 2**20
    # this image's peak (ru_maxrss would count the parent's pages, copied at fork)
    out = {"wall": wall, "rss_mb": rss_mb, "peak_mb": status_bytes("VmHWM") / 2**20}
    print(json.dumps({**out, "facts": facts, **extra}))


def run(path: Path, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(*a.child)
        return
    root = Path(tempfile.mkdtemp(prefix="store_open_"))
    path = root / "store"
    built = build(path, a.n, a.batch)
    sizes = {
        name: (path / name).stat().st_size for name in ("index.jsonl", "records.bin", "samples.bin")
    }
    rows = []
    for mode in ("binary", "jsonl", "lookup"):
        runs = [run(path, mode) for _ in range(a.rounds)]
        best = min(runs, key=lambda r: r["wall"])
        log(f"{mode}: {runs}")
        lookup = f"{best['lookup_s']:.2f} s" if "lookup_s" in best else ""
        rss = max(r["rss_mb"] for r in runs)
        peak = max(r["peak_mb"] for r in runs)
        rows.append([mode, f"{best['wall']:.3f}", f"{rss:.1f}", f"{peak:.0f}", lookup])
    facts = best["facts"]
    title = f"opening a {a.n}-sample store ({facts[0]} records of {a.batch})"
    extra = {k: f"{v / 2**20:.1f} MiB" for k, v in sizes.items()}
    extra["write"] = f"{built:.0f} s ({a.n / built:,.0f} samples/s, fsync off)"
    head = "open via|seconds (best)|resident MB added|process peak MB|first lookup"
    print(header(title, extra) + "\n" + md_table(head, rows))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
