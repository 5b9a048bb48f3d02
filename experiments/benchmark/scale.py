"""Scoring at scale: ``top_k`` over a >= 50k-sample store, and 1 vs 2 ``gloo`` ranks.

* ``scale``: capture ``--n`` train samples (GPT-2 1x64, vocab 256, seq 32, a dense projection
  to 256 per layer) and 100 queries, then ``attribute_sources(..., top_k=10)`` over the first
  5k, 20k and all ``--n`` samples, each in a fresh process (its peak memory is its own: it must
  stay flat as the store grows).
* ``ranks``: the full matrix and ``top_k`` of ``--rank-n`` unprojected samples (GPT-2 2x128,
  vocab 1000) x 100 queries with 1 and 2 ranks (each calls ``attribute_from_cache``; the train
  records are split), interleaved rounds; on a shared 2-core machine the free cores bound it.

    OMP_NUM_THREADS=1 python experiments/benchmark/scale.py --parts scale,ranks --n 50000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import torch  # noqa: E402
from utils.env import header  # noqa: E402
from utils.table import fmt_bytes, fmt_s, md_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(BENCH_DIR))
SCALE = dict(n_layer=1, width=64, vocab=256, seq=32, proj=256)  # the >= 50k store
RANKS = dict(n_layer=2, width=128, vocab=1000, seq=32, proj=None)  # compute-bound scoring


def log(msg: str) -> None:
    print(f"[scale] {msg}", file=sys.stderr, flush=True)


def capture(root: str, n: int, seed: int, spec: dict, bs: int = 64) -> dict:
    """Capture ``n`` random-token samples into ``root`` (training-style loop, frozen weights)."""
    from utils.models import ModelShape, batch_loss, build_model

    from dattri_llm import (
        GradientStorageManager,
        HookManager,
        HookManagerConfig,
        OffloadCallback,
        ProjectionConfig,
    )

    shape = ModelShape("gpt2", spec["n_layer"], spec["width"], 2, spec["vocab"], spec["seq"], 64)
    model = build_model(shape).eval()
    proj = ProjectionConfig("dense", spec["proj"], seed=0) if spec["proj"] else None
    cfg = HookManagerConfig(projection=proj, exclude=[r"transformer\.wpe"])
    store = GradientStorageManager(root, fsync=False)
    hm = HookManager(model, config=cfg, callbacks=[OffloadCallback(file_manager=store)])
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    with hm.collect():
        for i in range(0, n, bs):
            ids = torch.randint(0, spec["vocab"], (min(bs, n - i), spec["seq"]), generator=g)
            model.zero_grad(set_to_none=True)
            batch_loss(model, ids).backward()
    hm.remove()
    store.close()
    size = sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())
    return {"n": n, "wall": time.perf_counter() - t0, "bytes": size}


def child_score(root: str, n: int, top_k: int) -> dict:
    """``top_k`` over the first records holding >= ``n`` samples (run in a fresh process)."""
    from utils.memory import peak_rss_bytes

    from dattri_llm import AttributionArguments, TracInAttributor
    from dattri_llm.attribution.engine.units import units_of
    from dattri_llm.gradient.sources import DiskGradientSource

    args = AttributionArguments(output_dir=f"{root}/scores", use_cpu=True, show_progress=False)
    train = units_of(DiskGradientSource(f"{root}/train"))
    keep, rows = [], 0
    for u in train.units:
        if rows >= n:
            break
        keep.append(u)
        rows += u.num_rows
    train, test, box = train.subset(keep), DiskGradientSource(f"{root}/test"), {}

    def run():
        t0, c0 = time.perf_counter(), time.process_time()
        s = TracInAttributor(args).attribute_sources(train, test, top_k=top_k)
        box["wall"], box["cpu"] = time.perf_counter() - t0, time.process_time() - c0
        return s

    peak, s = peak_rss_bytes(run)
    return {"n": rows, **box, "peak": peak, "kept_rows": len(s.train_hashes)}


def child_rank(root: str, rank: int, world: int, port: str, top_k: int | None) -> dict:
    """One rank of a ``world``-rank ``attribute_from_cache`` (the wall time of the call)."""
    import torch.distributed as dist

    if world > 1:
        init = f"tcp://127.0.0.1:{port}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from dattri_llm import AttributionArguments, TracInAttributor

    args = AttributionArguments(output_dir=f"{root}/scores", use_cpu=True, show_progress=False)
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    s = TracInAttributor(args).attribute_from_cache(f"{root}/train", f"{root}/test", top_k=top_k)
    out = {"wall": time.perf_counter() - t0, "rows": len(s.train_hashes)}
    if world > 1:
        dist.destroy_process_group()
    return out


def spawn(*args: object) -> subprocess.Popen:
    """This script as ``--child ARGS`` in a fresh single-threaded process of this checkout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(args)]
    pipe = subprocess.PIPE
    return subprocess.Popen(argv, stdout=pipe, stderr=pipe, text=True, env=env)


def result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def part_scale(root: str, n: int, sizes: list[int], k: int) -> str:
    log(f"capturing {n} train samples")
    cap = capture(os.path.join(root, "train"), n, seed=1, spec=SCALE)
    capture(os.path.join(root, "test"), 100, seed=2, spec=SCALE)
    rows = []
    for m in sizes:
        r = result(spawn("score", root, m, k))
        log(f"scored {r['n']}: {r['wall']:.1f}s, peak {r['peak'] / 1e6:.0f} MB")
        rate = f"{r['n'] / r['wall']:.0f}"
        rows.append([r["n"], fmt_s(r["wall"]), fmt_s(r["cpu"]), rate, fmt_bytes(r["peak"])])
        rows[-1].append(r["kept_rows"])
    return (
        f"### {n} train samples, dense projection 256 per layer (GPT-2 1x64, vocab 256, seq 32), "
        f"100 queries, top_k={k}\n\n"
        + md_table(["train samples", "wall", "CPU", "samples/s", "peak memory", "rows kept"], rows)
        + f"\nCapture of {n} samples: {fmt_s(cap['wall'])} wall ({n / cap['wall']:.0f} samples/s), "
        f"store {fmt_bytes(cap['bytes'])} ({cap['bytes'] / n / 1e3:.1f} KB per sample).\n"
    )


def part_ranks(root: str, n: int, rounds: int) -> str:
    root = os.path.join(root, "ranks")
    log(f"capturing {n} train samples (unprojected)")
    capture(os.path.join(root, "train"), n, seed=1, spec=RANKS)
    capture(os.path.join(root, "test"), 100, seed=2, spec=RANKS)
    rows = []
    for top_k in (None, 10):
        times: dict[int, list[float]] = {1: [], 2: []}
        for r in range(rounds):
            for world in (1, 2) if r % 2 == 0 else (2, 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = str(s.getsockname()[1])
                procs = [spawn("rank", root, rank, world, port, top_k) for rank in range(world)]
                times[world].append([result(p) for p in procs][0]["wall"])  # rank 0's
                log(f"ranks={world} top_k={top_k}: {times[world][-1]:.1f}s")
        med = {w: sorted(t)[len(t) // 2] for w, t in times.items()}
        what = "full matrix" if top_k is None else f"top_k={top_k}"
        rates = [f"{n / med[1]:.0f}", f"{n / med[2]:.0f}", f"{med[1] / med[2]:.2f}x"]
        rows.append([what, fmt_s(med[1]), fmt_s(med[2]), *rates])
    return (
        f"### Scoring throughput with 1 and 2 gloo ranks: {n} train samples x 100 queries "
        f"(GPT-2 2x128, seq 32, unprojected: per-sample gradients formed at scoring), median of "
        f"{rounds} interleaved rounds, wall clock\n\n"
        + md_table(
            ["result", "1 rank", "2 ranks", "samples/s (1)", "samples/s (2)", "speed-up"], rows
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="scale,ranks")
    p.add_argument("--n", type=int, default=50000)
    p.add_argument("--rank-n", type=int, default=2000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        torch.set_num_threads(1)
        what, *args = json.loads(a.child)
        print(json.dumps((child_score if what == "score" else child_rank)(*args)), flush=True)
        return
    n = 2000 if a.quick else a.n
    sizes = [500, 1000, 2000] if a.quick else [5000, 20000, n]
    models = "GPT-2 from config (random weights), every layer but wpe; sizes below"
    print(header("Scoring at scale: 50k-sample store, top-k, ranks", {"models": models}))
    root = tempfile.mkdtemp(prefix="dattri_scale_")
    try:
        if "scale" in a.parts:
            print(part_scale(root, n, sizes, a.k), flush=True)
        if "ranks" in a.parts:
            print(part_ranks(root, 256 if a.quick else a.rank_n, 1 if a.quick else a.rounds))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
