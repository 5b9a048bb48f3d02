"""Scoring at scale: a >= 50k-sample store, top-k streaming, ranks.

Parts (CPU, one thread per process):

* ``scale`` — capture ``N`` train samples (GPT-2 2x128 from config, vocab 1000, seq 32, batch
  64) with a dense projection to 256 per layer into a gradient store, and 100 queries; then
  ``TracInAttributor.attribute_from_cache(..., top_k=10)`` over the first 5k, 20k and all ``N``
  records' samples (each scoring in a fresh process, so its peak resident memory is its own).
  Reported: capture throughput, store size, scoring throughput, peak memory (it must stay flat
  as ``N`` grows) and the cost per 1M samples extrapolated linearly.
* ``ranks`` — scoring throughput with 1 and 2 ``gloo`` ranks on the same store (``torchrun``
  style: every rank calls ``attribute_from_cache``; the train records are split), full matrix and
  ``top_k``; on a shared 2-core machine the ratio is bounded by the free cores.
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


def model_and_config(spec: dict) -> tuple[torch.nn.Module, object]:
    from utils.models import ModelShape, build_model

    from dattri_llm import HookManagerConfig, ProjectionConfig

    shape = ModelShape("gpt2", spec["n_layer"], spec["width"], 2, spec["vocab"], spec["seq"], 64)
    model = build_model(shape).eval()
    proj = ProjectionConfig("dense", spec["proj"], seed=0) if spec["proj"] else None
    cfg = HookManagerConfig(projection=proj, exclude=[r"transformer\.wpe"])
    return model, cfg


def capture(root: str, n: int, seed: int, spec: dict, bs: int = 64) -> dict:
    """Capture ``n`` samples into ``root`` (training-style loop, frozen weights)."""
    from utils.models import batch_loss

    from dattri_llm import GradientStorageManager, HookManager, OffloadCallback

    model, cfg = model_and_config(spec)
    store = GradientStorageManager(root, fsync=False)
    hm = HookManager(model, config=cfg, callbacks=[OffloadCallback(file_manager=store)])
    g = torch.Generator().manual_seed(seed)
    t0, c0 = time.perf_counter(), time.process_time()
    with hm.collect():
        for i in range(0, n, bs):
            ids = torch.randint(0, spec["vocab"], (min(bs, n - i), spec["seq"]), generator=g)
            model.zero_grad(set_to_none=True)
            batch_loss(model, ids).backward()
    hm.remove()
    store.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = sum(f.stat().st_size for f in __import__("pathlib").Path(root).rglob("*") if f.is_file())
    return {"n": n, "wall": wall, "cpu": cpu, "bytes": size}


_SCORE = """
import json, sys, time
sys.path.insert(0, {bench!r})
from utils.memory import peak_rss_bytes
import torch
torch.set_num_threads(1)
from dattri_llm import AttributionArguments, TracInAttributor
from dattri_llm.attribution.engine.units import units_of
from dattri_llm.gradient.sources import DiskGradientSource
n, top_k = int(sys.argv[1]), sys.argv[2]
top_k = None if top_k == "none" else int(top_k)
args = AttributionArguments(output_dir={out!r}, use_cpu=True, show_progress=False)
train = units_of(DiskGradientSource({train!r}))
keep, rows = [], 0
for u in train.units:
    if rows >= n:
        break
    keep.append(u)
    rows += u.num_rows
train = train.subset(keep)
test = DiskGradientSource({test!r})
box = {{}}
def run():
    t0, c0 = time.perf_counter(), time.process_time()
    s = TracInAttributor(args).attribute_sources(train, test, top_k=top_k)
    box["wall"], box["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    return s
peak, s = peak_rss_bytes(run)
print(json.dumps({{"n": rows, "wall": box["wall"], "cpu": box["cpu"], "peak": peak,
                  "kept_rows": len(s.train_hashes)}}))
"""


def _paths(root: str) -> dict[str, str]:
    names = {"train": "train", "test": "test", "out": "scores"}
    return {k: os.path.join(root, v) for k, v in names.items()}


def score_subprocess(root: str, n: int, top_k: int | None) -> dict:
    code = _SCORE.format(bench=BENCH_DIR, **_paths(root))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    argv = [sys.executable, "-c", code, str(n), "none" if top_k is None else str(top_k)]
    res = subprocess.run(argv, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def part_scale(root: str, n: int, sizes: list[int], k: int) -> str:
    log(f"capturing {n} train samples")
    cap = capture(os.path.join(root, "train"), n, seed=1, spec=SCALE)
    capture(os.path.join(root, "test"), 100, seed=2, spec=SCALE)
    per = cap["bytes"] / n
    rows = []
    for m in sizes:
        r = score_subprocess(root, m, k)
        log(f"scored {r['n']}: {r['wall']:.1f}s, peak {r['peak'] / 1e6:.0f} MB")
        rate = f"{r['n'] / r['wall']:.0f}"
        rows.append([r["n"], fmt_s(r["wall"]), fmt_s(r["cpu"]), rate, fmt_bytes(r["peak"])])
        rows[-1].append(r["kept_rows"])
    last = score_subprocess(root, sizes[-1], k)
    per_m = 1e6 / last["n"]
    plan = [
        [
            "capture (forward+backward, projection, store writes)",
            fmt_s(cap["wall"] * 1e6 / n),
            f"{n / cap['wall']:.0f} samples/s ({n / cap['cpu']:.0f} per CPU-s)",
        ],
        ["store on disk", fmt_bytes(per * 1e6), f"{per / 1e3:.1f} KB per sample"],
        [
            "scoring 100 queries, top_k",
            fmt_s(last["wall"] * per_m),
            f"{last['n'] / last['wall']:.0f} samples/s",
        ],
    ]
    return (
        f"### {n} train samples, dense projection 256 per layer (GPT-2 1x64, vocab 256, seq 32), "
        f"100 queries, top_k={k}\n\n"
        + md_table(["train samples", "wall", "CPU", "samples/s", "peak memory", "rows kept"], rows)
        + f"\nCapture of {n} samples: {fmt_s(cap['wall'])} wall ({n / cap['wall']:.0f} samples/s), "
        f"store {fmt_bytes(cap['bytes'])} ({per / 1e3:.1f} KB per sample).\n\n"
        + "Per 1M samples, extrapolated linearly from the largest run:\n\n"
        + md_table(["what", "per 1M samples", "measured rate"], plan)
    )


# ---- ranks ------------------------------------------------------------------------------------
_RANK = """
import json, os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, port, top_k = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
top_k = None if top_k == "none" else int(top_k)
if world > 1:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank,
                            world_size=world)
from dattri_llm import AttributionArguments, TracInAttributor
args = AttributionArguments(output_dir={out!r}, use_cpu=True, show_progress=False)
if world > 1:
    dist.barrier()
t0 = time.perf_counter()
s = TracInAttributor(args).attribute_from_cache({train!r}, {test!r}, top_k=top_k)
wall = time.perf_counter() - t0
if rank == 0:
    print(json.dumps({{"wall": wall, "rows": len(s.train_hashes)}}))
if world > 1:
    dist.destroy_process_group()
"""


def run_ranks(root: str, world: int, top_k: int | None) -> dict:
    code = _RANK.format(**_paths(root))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    argv = [sys.executable, "-c", code]
    pipe = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    procs = [
        subprocess.Popen([*argv, str(r), str(world), port, str(top_k or "none")], **pipe)
        for r in range(world)
    ]
    outs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(outs[0][1][-3000:] + outs[-1][1][-3000:])
    return json.loads(outs[0][0].strip().splitlines()[-1])


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
                times[world].append(run_ranks(root, world, top_k)["wall"])
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
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    n = 2000 if a.quick else a.n
    sizes = [500, 1000, 2000] if a.quick else [5000, 20000, n]
    print(
        header(
            "Scoring at scale: 50k-sample store, top-k, ranks",
            {
                "models": "GPT-2 from config (random weights), every layer but wpe; sizes below",
                "store": "GradientStorageManager(fsync=False) on the local disk",
            },
        )
    )
    root = a.dir or tempfile.mkdtemp(prefix="dattri_scale_")
    try:
        if "scale" in a.parts:
            print(part_scale(root, n, sizes, a.k), flush=True)
        if "ranks" in a.parts:
            print(part_ranks(root, 256 if a.quick else a.rank_n, 1 if a.quick else a.rounds))
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
