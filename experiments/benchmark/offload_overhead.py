"""Offload overhead: training steps (zero grads, forward, loss, backward, ``AdamW``; GPT-2 from
config) plain, under ``HookManager`` (factorized) with a callback that drops each record, and
with ``OffloadCallback`` into a fresh store, asynchronous (the default) and synchronous. Each
run is ``--steps`` steps in one collection context (the async writer overlaps the next steps)
ending with the store's flush, all timed; reported per step. Target: offload <= 1.10x plain.

    OMP_NUM_THREADS=1 python experiments/benchmark/offload_overhead.py [--quick]
"""

# ruff: noqa: E402  (torch is imported after the re-execution with one thread)
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env

if __name__ == "__main__":
    ensure_env()

import torch
from utils.env import header
from utils.models import ModelShape, batch_loss, build_model, describe, hook_config, make_batch
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table
from utils.timing import Variant, paired_ratio, time_interleaved

from dattri_llm import CaptureCallback, GradientStorageManager, HookManager, OffloadCallback

NAMES = {
    "plain": "plain training step",
    "hook": "hook factorized (record dropped)",
    "offload async": "hook + OffloadCallback (async writer)",
    "offload sync": "hook + OffloadCallback (sync writes)",
}


def log(msg: str) -> None:
    print(f"[offload] {msg}", file=sys.stderr, flush=True)


class Run:
    """``steps`` training steps, optionally under a hook manager with an offload store."""

    def __init__(
        self, model: torch.nn.Module, batches: list[torch.Tensor], kind: str, root: str
    ) -> None:
        self.model, self.batches, self.kind, self.root = model, batches, kind, root
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        self.hm: HookManager | None = None
        self.store: GradientStorageManager | None = None
        self.dir, self.bytes_written = None, 0

    def setup(self) -> None:
        if self.kind == "plain":
            return
        if self.kind == "hook":
            cbs = [CaptureCallback()]
        else:
            self.dir = tempfile.mkdtemp(prefix="offload-", dir=self.root)
            store_dir, is_async = os.path.join(self.dir, "store"), self.kind == "offload async"
            self.store = GradientStorageManager(store_dir, async_write=is_async)
            cbs = [OffloadCallback(offload_interval=1, file_manager=self.store,
                                   recording_type="per_sample")]  # fmt: skip
        self.hm = HookManager(self.model, config=hook_config(self.model), callbacks=cbs)

    def teardown(self) -> None:
        if self.hm is not None:
            self.hm.remove()
            self.hm = None
        if self.store is not None:
            self.store.close()
            files = ((d, f) for d, _, fs in os.walk(self.dir) for f in fs)
            self.bytes_written = sum(os.path.getsize(os.path.join(d, f)) for d, f in files)
            self.store = None
            shutil.rmtree(self.dir, ignore_errors=True)

    def __call__(self) -> None:
        with self.hm.collect() if self.hm else contextlib.nullcontext():  # exit: store flushed
            for ids in self.batches:
                self.opt.zero_grad(set_to_none=True)
                batch_loss(self.model, ids).backward()
                self.opt.step()


def bench(shape: ModelShape, steps: int, rounds: int, root: str) -> str:
    model = build_model(shape)
    batches = [make_batch(shape, seed=s) for s in range(steps)]
    runs = {k: Run(model, batches, k, root) for k in NAMES}
    variants = [Variant(NAMES[k], r, r.setup, r.teardown) for k, r in runs.items()]
    log(describe(shape, model))
    t = time_interleaved(variants, rounds=rounds, warmup=1, log=log)
    base = t[NAMES["plain"]]
    rows = []
    for k, r in runs.items():
        tv = t[NAMES[k]]
        ratio, cpu_ratio = paired_ratio(tv, base), paired_ratio(tv, base, cpu=True)
        target = ""
        if k == "offload async":
            met = ("met" if x <= 1.10 else "MISSED" for x in (ratio, cpu_ratio))
            target = "<= 1.10x: wall {}, CPU {}".format(*met)
        written, rate = "", ""
        if r.bytes_written:
            written = fmt_bytes(r.bytes_written / steps)
            rate = f"{r.bytes_written / 1e6 / tv.median:.0f} MB/s"
        times = [fmt_s(tv.median / steps), fmt_s(tv.cpu_median / steps)]
        rows.append([NAMES[k], *times, fmt_x(ratio), fmt_x(cpu_ratio), target, written, rate])
    return f"### {describe(shape, model)}, {steps} steps per run, AdamW\n\n" + md_table(
        (
            "variant|wall / step (median)|CPU / step (median)|ratio vs plain (wall)|"
            "ratio (CPU, writer thread included)|target|written / step|write rate"
        ),
        rows,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the scratch stores go (default: tmp)")
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    steps = args.steps or (4 if args.quick else 6)
    root = args.dir or tempfile.gettempdir()
    store = f"fresh GradientStorageManager per run under {root} (same disk as the repo), "
    store += "deleted after; default options (fsync on, CRC-32, max_pending=1)"
    timing = f"{rounds} interleaved rounds of {steps} steps after a warm-up run; the run's "
    timing += "closing flush is inside the timed region"
    print(header("Offload overhead", {"store": store, "timing": timing}))
    quick = [(2, 128, 4, 4096, 64)]
    sizes = quick if args.quick else [(4, 256, 4, 50257, 64), (6, 512, 8, 50257, 128)]
    for shape in (ModelShape("gpt2", *size, 8) for size in sizes):
        print(bench(shape, steps, rounds, root), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
