"""``top_k`` scoring of a projected store against the machine's limit.

A synthetic store of ``--n`` samples (``--layers`` materialized layers, ``--dim`` numbers in
all, records of ``--batch`` rows) and ``--queries`` test samples; the limit is the slower of an
in-memory ``torch.mm`` of the same shape and a page-cache read of the store's shards; the
scoring is ``attribute_from_cache(top_k=k)`` in a fresh process (its own peak memory), with
the vector fast path and, with ``--general``, without the CRC-32 check and the general loop
(the same top-10 asserted).

    OMP_NUM_THREADS=1 python experiments/benchmark/scoring_limit.py --n 100000 --general
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
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from utils.env import header  # noqa: E402
from utils.memory import status_bytes  # noqa: E402
from utils.table import md_table  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def write_store(
    path: Path, n: int, dim: int, layers: int, batch: int, seed: int, prefix: str
) -> None:
    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient import Gradient, GradientRecord, Materialized

    width = dim // layers
    kw = {"_d": width, "proj_dim": width, "seed": 0, "source_layer_type": "nn.Linear"}
    gen = torch.Generator().manual_seed(seed)
    with GradientStorageManager(path, fsync=False) as store:
        for step, lo in enumerate(range(0, n, batch)):
            b = min(batch, n - lo)
            grads = {
                f"layer{i}": Materialized(
                    torch.randn(b, width, generator=gen), "projected.dense", kw
                )
                for i in range(layers)
            }
            ids = [hashlib.sha256(f"{prefix}{j}".encode()).hexdigest() for j in range(lo, lo + b)]
            store.write(GradientRecord(step, ids, Gradient(grads)))


def read_limit(files: list[Path]) -> tuple[float, float]:
    """``(wall, CPU)`` seconds to read every file sequentially from the page cache (2nd pass)."""
    buf = bytearray(max(f.stat().st_size for f in files))
    view = memoryview(buf)
    times = []
    for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                got = 0
                while k := fh.readinto(view[got:]):
                    got += k
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times[-1]


def matmul_limit(n: int, dim: int, m: int, resident: int) -> tuple[float, float]:
    """``(wall, CPU)`` seconds of ``X @ Q.T`` over ``n`` float32 rows in memory (best of 2)."""
    gen = torch.Generator().manual_seed(1)
    rows = min(n, max(1, resident // (dim * 4)))
    x = torch.randn(rows, dim, generator=gen)
    q = torch.randn(m, dim, generator=gen)
    best = (float("inf"), float("inf"))
    for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        done = 0
        while done < n:
            r = min(rows, n - done)
            torch.mm(x[:r], q.T)
            done += r
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    return best


def score_child(train: str, test: str, k: int, mode: str) -> None:
    from dattri_llm import AttributionArguments, GradientStorageManager, TracInAttributor
    from dattri_llm.attribution.engine import vector_scan

    vector_scan.ENABLED = mode != "general"
    if mode == "no-verify":  # the store's CRC-32 check of every shard's first read, off
        train = GradientStorageManager(train, verify=False)
    args = AttributionArguments(use_cpu=True, show_progress=False, output_dir=None)
    t0, c0 = time.perf_counter(), time.process_time()
    score = TracInAttributor(args).attribute_from_cache(train, test, top_k=k)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    top = score.top_k(k)
    digest = hashlib.sha256(json.dumps(top.proponent_hashes).encode()).hexdigest()[:12]
    peak_mb = status_bytes("VmHWM") / 2**20
    print(json.dumps({"wall": wall, "cpu": cpu, "peak_mb": peak_mb, "top": digest}))


def score(train: Path, test: Path, k: int, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(train), str(test), str(k), mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--general", action="store_true", help="also verify=False, the general loop")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.child:
        train, test, k, mode = a.child
        score_child(train, test, int(k), mode)
        return
    root = Path(tempfile.mkdtemp(prefix="scoring_limit_"))
    train, test = root / "train", root / "test"
    write_store(train, a.n, a.dim, a.layers, a.batch, 0, "t")
    write_store(test, a.queries, a.dim, a.layers, a.batch, 1, "q")
    modes = ["fast", "no-verify", "general"] if a.general else ["fast"]
    results = {mode: score(train, test, a.k, mode) for mode in modes}  # before any large matrix
    files = sorted((train / "shards").glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    t_read = read_limit(files)
    t_mm = matmul_limit(a.n, a.dim, a.queries, 2**31)  # one resident slab of at most 2 GiB
    limit = (max(t_read[0], t_mm[0]), max(t_read[1], t_mm[1]))

    def row(what: str, wall: float, cpu: float, *rest: str) -> list[str]:
        return [what, f"{wall:.3f}", f"{cpu:.3f}", f"{a.n / wall:,.0f}", *rest]

    rows = [row("matmul limit (torch.mm, in memory)", *t_mm, "", "")]
    rows.append(
        row("read limit (page cache)", *t_read, f"{nbytes / t_read[0] / 2**30:.2f} GiB/s", "")
    )
    names = {
        "fast": "top_k, vector fast path",
        "no-verify": "top_k, vector fast path, verify=False (no CRC-32)",
        "general": "top_k, general loop",
    }
    for mode, r in results.items():
        ratio = f"{limit[0] / r['wall']:.2f} (CPU {limit[1] / r['cpu']:.2f})"
        rows.append(row(names[mode], r["wall"], r["cpu"], ratio, f"{r['peak_mb']:.0f} MB"))
    assert len({r["top"] for r in results.values()}) == 1, "the paths ranked differently"
    head = "what|wall s|CPU s|samples/s (wall)|limit / time (wall, CPU)|peak RSS"
    title = (
        f"scoring at the limit: {a.n} samples x {a.dim} numbers ({a.layers} layers, "
        f"float32, records of {a.batch}), {a.queries} queries, top_k={a.k}"
    )
    print(header(title, {"store": f"{nbytes / 2**20:.0f} MiB"}) + "\n" + md_table(head, rows))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
