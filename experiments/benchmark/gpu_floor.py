"""The floor table on CUDA (fp32 / bf16) and the per-sample costs behind the capacity plan.

Parts:

* ``floor`` — live ``TracInAttributor.attribute()`` / one plain forward+backward over the same
  samples (GPT-2 from config, vocab 1000, seq 64, batch 8, every layer but ``wpe``), timed with
  CUDA synchronisation (median of ``--rounds`` after a warm-up), and the peak GPU memory of each
  (``torch.cuda.max_memory_allocated`` above what was allocated before).
* ``capacity`` — GPT-2 12x768 (124M parameters, vocab 50257, seq 512, bf16): a plain
  training step's throughput, capture into a gradient store with a LoGra projection (16 x 16
  per layer, the attention and MLP linear layers of every block) and its bytes per sample, and
  ``top_k`` scoring of that store against 256 queries.

Usage (on a GPU machine)::

    python experiments/benchmark/gpu_floor.py --parts floor,capacity
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from utils.models import ModelShape, batch_loss, build_model, make_batch  # noqa: E402


def log(msg: str) -> None:
    print(f"[gpu] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, int]:
    """(seconds, peak bytes above the allocation before) of one call."""
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    return dt, peak


def part_floor(device: torch.device, rounds: int, quick: bool) -> list[dict]:
    from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
    from dattri_llm.gradient.hooks import HookManagerConfig

    rows_spec = (
        [((2, 128), 16, 8)]
        if quick
        else [
            ((4, 256), 64, 16),
            ((4, 512), 64, 16),
            ((6, 512), 64, 16),
            ((4, 1024), 64, 16),
            ((4, 512), 256, 32),
            ((4, 256), 1024, 64),
        ]
    )
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for (nl, w), n, m in rows_spec:
            shape = ModelShape("gpt2", nl, w, max(2, w // 64), 1000, 64, 8)
            model = build_model(shape, dtype=dtype).to(device)
            train = make_batch(shape, n=n, seed=1).to(device)
            test = make_batch(shape, n=m, seed=2).to(device)
            both = torch.cat([train, test])
            tr = [{"input_ids": x} for x in train]
            te = [{"input_ids": x} for x in test]
            cfg = HookManagerConfig(exclude=[r"transformer\.wpe"])
            args = AttributionArguments(
                output_dir="unused", use_cpu=device.type == "cpu", show_progress=False
            )
            att = TracInAttributor(
                args, task=AttributionTask(lambda mod, b: batch_loss(mod, b["input_ids"]), model)
            )

            def plain(model=model, both=both) -> None:
                for i in range(0, len(both), 8):
                    model.zero_grad(set_to_none=True)
                    batch_loss(model, both[i : i + 8]).backward()
                model.zero_grad(set_to_none=True)

            def attribute(att=att, tr=tr, te=te, cfg=cfg) -> None:
                att.attribute(tr, te, hook_config=cfg)

            plain(), attribute()
            ps, ats = [], []
            for _ in range(rounds):
                ps.append(timed(plain, device))
                ats.append(timed(attribute, device))
            ratio = sorted(a[0] / p[0] for a, p in zip(ats, ps))[len(ps) // 2]
            row = {
                "dtype": str(dtype).split(".")[-1],
                "model": f"{nl}x{w}",
                "n": n,
                "m": m,
                "plain_s": sorted(p[0] for p in ps)[len(ps) // 2],
                "attr_s": sorted(a[0] for a in ats)[len(ats) // 2],
                "ratio": ratio,
                "peak_attr": max(a[1] for a in ats),
                "peak_plain": max(p[1] for p in ps),
            }
            log(json.dumps(row))
            out.append(row)
            del model, att
    return out


def part_capacity(device: torch.device, quick: bool) -> dict:
    from dattri_llm import (
        AttributionArguments,
        GradientStorageManager,
        HookManager,
        HookManagerConfig,
        OffloadCallback,
        ProjectionConfig,
        TracInAttributor,
    )

    if quick:
        shape, n, q, bs = ModelShape("gpt2", 2, 128, 2, 1000, 64, 8), 64, 16, 8
    else:
        shape, n, q, bs = ModelShape("gpt2", 12, 768, 12, 50257, 512, 16), 4096, 256, 16
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(shape, dtype=dtype).to(device)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)

    def batches(count: int):
        for i in range(0, count, bs):
            yield torch.randint(0, shape.vocab, (min(bs, count - i), shape.seq), generator=g).to(
                device
            )

    def plain() -> None:
        for ids in batches(min(n, 512)):
            model.zero_grad(set_to_none=True)
            batch_loss(model, ids).backward()

    plain()
    t_plain, peak_plain = timed(plain, device)
    root = tempfile.mkdtemp(prefix="dattri_gpu_")
    proj = ProjectionConfig("logra", proj_dim_in=16, proj_dim_out=16, seed=0)
    # LoGra applies to linear layers: the attention and MLP projections of every block
    cfg = HookManagerConfig(linear_io=[r".*\.(attn|mlp)\.c_(attn|proj|fc)"], projection=proj)
    try:

        def capture(where: str, count: int) -> None:
            store = GradientStorageManager(os.path.join(root, where), fsync=False)
            hm = HookManager(model, config=cfg, callbacks=[OffloadCallback(file_manager=store)])
            with hm.collect():
                for ids in batches(count):
                    model.zero_grad(set_to_none=True)
                    batch_loss(model, ids).backward()
            hm.remove()
            store.close()

        t_cap, peak_cap = timed(lambda: capture("train", n), device)
        capture("test", q)
        size = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(root, "train"))
            for f in fs
        )
        args = AttributionArguments(
            output_dir=os.path.join(root, "scores"),
            use_cpu=device.type == "cpu",
            show_progress=False,
            score_memory_gb=8,
        )
        att = TracInAttributor(args)

        def score() -> None:
            att.attribute_from_cache(
                os.path.join(root, "train"), os.path.join(root, "test"), top_k=100
            )

        score()
        t_score, peak_score = timed(score, device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "model": f"gpt2 {shape.n_layer}x{shape.width} vocab {shape.vocab} seq {shape.seq}",
        "params": params,
        "dtype": str(dtype).split(".")[-1],
        "plain_samples_per_s": min(n, 512) / t_plain,
        "capture_samples_per_s": n / t_cap,
        "bytes_per_sample": size / n,
        "score_samples_per_s": n / t_score,
        "queries": q,
        "peak_plain": peak_plain,
        "peak_capture": peak_cap,
        "peak_score": peak_score,
    }
    log(json.dumps(out))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="floor,capacity")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = torch.device(a.device)
    info = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    res: dict = {"info": info}
    for part in a.parts.split(","):  # in the order given; the JSON is rewritten after each
        if part == "floor":
            res["floor"] = part_floor(device, a.rounds, a.quick)
        elif part == "capacity":
            res["capacity"] = part_capacity(device, a.quick)
        if a.json:
            with open(a.json, "w") as f:
                f.write(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
