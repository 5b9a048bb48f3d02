"""The floor table on CUDA (fp32 / bf16) and the per-sample costs behind the capacity plan.

* ``floor``: live ``TracInAttributor.attribute()`` / one plain forward+backward over the same
  samples (the CPU floor table's models), CUDA-synchronised, median of ``--rounds`` after a
  warm-up, with peak GPU memory (``max_memory_allocated`` above the start) of each;
* ``capacity``: GPT-2 12x768 (vocab 50257, seq 512, bf16): a plain step's throughput, capture
  into a store with LoGra 16 x 16 on every attention / MLP linear layer (bytes per sample) and
  ``top_k`` scoring of that store against 256 queries.

Each part prints its JSON as it ends. On a GPU machine::

    python experiments/benchmark/gpu_floor.py --parts floor,capacity --rounds 3
"""

# ruff: noqa: E402  (utils is found through the script's folder)
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from utils.models import (
    FLOOR_ROWS,
    ModelShape,
    batch_loss,
    build_model,
    floor_shape,
    make_batch,
    plain_fwd_bwd,
)
from utils.timing import med

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    ProjectionConfig,
    TracInAttributor,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def timed(fn: object) -> tuple[float, int]:
    """(seconds, peak bytes above the allocation before) of one call (no peak on a CPU)."""
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.synchronize(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
    base, t0 = torch.cuda.memory_allocated(DEVICE) if cuda else 0, time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(DEVICE)
    dt = time.perf_counter() - t0
    return dt, torch.cuda.max_memory_allocated(DEVICE) - base if cuda else 0


def part_floor(rounds: int, quick: bool) -> list[dict]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for spec, n, m in [("2x128", 16, 8)] if quick else FLOOR_ROWS:
            shape = floor_shape(spec)
            model = build_model(shape, dtype=dtype).to(DEVICE)
            train = make_batch(shape, n=n, seed=1).to(DEVICE)
            test = make_batch(shape, n=m, seed=2).to(DEVICE)
            tr, te = [{"input_ids": x} for x in train], [{"input_ids": x} for x in test]
            cfg = HookManagerConfig(exclude=[r"transformer\.wpe"])
            cpu = DEVICE.type == "cpu"
            args = AttributionArguments(output_dir="unused", use_cpu=cpu, show_progress=False)
            task = AttributionTask(lambda mod, b: batch_loss(mod, b["input_ids"]), model)
            att = TracInAttributor(args, task=task)

            both = torch.cat([train, test])

            def plain(model=model, both=both) -> None:
                plain_fwd_bwd(model, both, 8)

            def attribute(att=att, tr=tr, te=te, cfg=cfg) -> None:
                att.attribute(tr, te, hook_config=cfg)

            plain(), attribute()  # warm-up
            ps, ats = [], []
            for _ in range(rounds):
                ps.append(timed(plain))
                ats.append(timed(attribute))
            row = {"dtype": str(dtype).split(".")[-1], "model": spec, "n": n, "m": m,
                   "plain_s": med([p[0] for p in ps]), "attr_s": med([a[0] for a in ats]),
                   "ratio": med([a[0] / p[0] for a, p in zip(ats, ps)]),
                   "peak_attr": max(a[1] for a in ats),
                   "peak_plain": max(p[1] for p in ps)}  # fmt: skip
            print(f"[gpu] {json.dumps(row)}", file=sys.stderr, flush=True)
            out.append(row)
            del model, att
    return out


def part_capacity(quick: bool) -> dict:
    if quick:
        shape, n, q, bs = ModelShape("gpt2", 2, 128, 2, 1000, 64, 8), 64, 16, 8
    else:
        shape, n, q, bs = ModelShape("gpt2", 12, 768, 12, 50257, 512, 16), 4096, 256, 16
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    model = build_model(shape, dtype=dtype).to(DEVICE)
    g = torch.Generator().manual_seed(0)

    def batches(count: int) -> object:
        for i in range(0, count, bs):
            size = (min(bs, count - i), shape.seq)
            yield torch.randint(0, shape.vocab, size, generator=g).to(DEVICE)

    def steps(count: int) -> None:
        for ids in batches(count):
            model.zero_grad(set_to_none=True)
            batch_loss(model, ids).backward()

    n_plain = min(n, 512)
    steps(n_plain)  # warm-up
    t_plain, peak_plain = timed(lambda: steps(n_plain))
    root = tempfile.mkdtemp(prefix="dattri_gpu_")
    proj = ProjectionConfig("logra", proj_dim_in=16, proj_dim_out=16, seed=0)
    # LoGra applies to linear layers: the attention and MLP projections of every block
    cfg = HookManagerConfig(linear_io=[r".*\.(attn|mlp)\.c_(attn|proj|fc)"], projection=proj)
    try:

        def capture(where: str, count: int) -> None:
            store = GradientStorageManager(os.path.join(root, where), fsync=False)
            hm = HookManager(model, config=cfg, callbacks=[OffloadCallback(file_manager=store)])
            with hm.collect():
                steps(count)
            hm.remove()
            store.close()

        t_cap, peak_cap = timed(lambda: capture("train", n))
        capture("test", q)
        files = os.walk(os.path.join(root, "train"))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in files for f in fs)
        args = AttributionArguments(output_dir=os.path.join(root, "scores"), show_progress=False,
                                    use_cpu=DEVICE.type == "cpu", score_memory_gb=8)  # fmt: skip
        att, dirs = TracInAttributor(args), [os.path.join(root, d) for d in ("train", "test")]
        score = lambda: att.attribute_from_cache(*dirs, top_k=100)  # noqa: E731
        score()  # warm-up
        t_score, peak_score = timed(score)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "model": f"gpt2 {shape.n_layer}x{shape.width} vocab {shape.vocab} seq {shape.seq}",
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).split(".")[-1],
        "plain_samples_per_s": n_plain / t_plain,
        "capture_samples_per_s": n / t_cap,
        "bytes_per_sample": size / n,
        "score_samples_per_s": n / t_score,
        "queries": q,
        "peak_plain": peak_plain,
        "peak_capture": peak_cap,
        "peak_score": peak_score,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="floor,capacity")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    print(json.dumps({"info": {"torch": torch.__version__, "device": name}}), flush=True)
    for part in a.parts.split(","):  # in the order given, each printed as it ends
        res = part_floor(a.rounds, a.quick) if part == "floor" else part_capacity(a.quick)
        print(json.dumps({part: res}, indent=1), flush=True)


if __name__ == "__main__":
    main()
