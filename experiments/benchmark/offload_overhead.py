"""Offload overhead: a training step with HookManager + OffloadCallback vs plain.

A training step here is zero grads, forward, loss, backward and an ``AdamW`` step on a
GPT-2-shaped model built from config. Each variant runs ``--steps`` consecutive steps inside
one collection context (so an asynchronous writer overlaps with the next steps) and ends with
the store's flush (``on_context_end``), all timed; the figure is seconds per step. Variants:

* plain training step;
* ``HookManager`` (factorized capture) with a ``CaptureCallback`` that drops each record;
* the same with ``OffloadCallback`` into a fresh ``GradientStorageManager`` (default:
  asynchronous writes, ``max_pending=1``, fsync on), and with synchronous writes.

Target: offloading adds <= 10% to the plain step (factorized capture).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import torch  # noqa: E402
from utils.env import header  # noqa: E402
from utils.models import (  # noqa: E402
    ModelShape,
    batch_loss,
    build_model,
    describe,
    hook_config,
    make_batch,
)
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table  # noqa: E402
from utils.timing import Variant, paired_ratio, time_interleaved  # noqa: E402

from dattri_llm import (  # noqa: E402
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
)


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
        self.dir: str | None = None
        self.bytes_written = 0

    def setup(self) -> None:
        if self.kind == "plain":
            return
        if self.kind == "hook":
            cbs = [CaptureCallback()]
        else:
            self.dir = tempfile.mkdtemp(prefix="offload-", dir=self.root)
            self.store = GradientStorageManager(
                os.path.join(self.dir, "store"), async_write=self.kind == "offload async"
            )
            cbs = [
                OffloadCallback(
                    offload_interval=1, file_manager=self.store, recording_type="per_sample"
                )
            ]
        self.hm = HookManager(self.model, config=hook_config(self.model), callbacks=cbs)

    def teardown(self) -> None:
        if self.hm is not None:
            self.hm.remove()
            self.hm = None
        if self.store is not None:
            self.store.close()
            self.bytes_written = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.dir) for f in fs
            )
            self.store = None
            shutil.rmtree(self.dir, ignore_errors=True)

    def _steps(self) -> None:
        for ids in self.batches:
            self.opt.zero_grad(set_to_none=True)
            batch_loss(self.model, ids).backward()
            self.opt.step()

    def __call__(self) -> None:
        if self.hm is None:
            self._steps()
            return
        with self.hm.collect():  # on exit: OffloadCallback flushes the store
            self._steps()


def bench(shape: ModelShape, steps: int, rounds: int, root: str) -> str:
    model = build_model(shape)
    batches = [make_batch(shape, seed=s) for s in range(steps)]
    runs = {
        k: Run(model, batches, k, root) for k in ("plain", "hook", "offload async", "offload sync")
    }
    names = {
        "plain": "plain training step",
        "hook": "hook factorized (record dropped)",
        "offload async": "hook + OffloadCallback (async writer)",
        "offload sync": "hook + OffloadCallback (sync writes)",
    }
    variants = [Variant(names[k], r, r.setup, r.teardown) for k, r in runs.items()]
    log(describe(shape, model))
    t = time_interleaved(variants, rounds=rounds, warmup=1, log=log)
    base = t[names["plain"]]
    rows = []
    for k, r in runs.items():
        tv = t[names[k]]
        ratio = paired_ratio(tv, base)
        cpu_ratio = paired_ratio(tv, base, cpu=True)
        target = ""
        if k == "offload async":
            target = (
                f"<= 1.10x: wall {'met' if ratio <= 1.10 else 'MISSED'}, "
                f"CPU {'met' if cpu_ratio <= 1.10 else 'MISSED'}"
            )
        per_step = r.bytes_written / steps if r.bytes_written else None
        rate = f"{r.bytes_written / 1e6 / (tv.median):.0f} MB/s" if r.bytes_written else ""
        times = [fmt_s(tv.median / steps), fmt_s(tv.cpu_median / steps)]
        written = fmt_bytes(per_step) if per_step else ""
        rows.append([names[k], *times, fmt_x(ratio), fmt_x(cpu_ratio), target, written, rate])
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
    print(
        header(
            "Offload overhead",
            {
                "store": f"fresh GradientStorageManager per run under {root} (same disk as the "
                "repo), deleted after; default options (fsync on, CRC-32, max_pending=1)",
                "timing": f"{rounds} interleaved rounds of {steps} steps after a warm-up run; the "
                "run's closing flush is inside the timed region",
            },
        )
    )
    shapes = [
        ModelShape("gpt2", 4, 256, 4, 50257, 64, 8),
        ModelShape("gpt2", 6, 512, 8, 50257, 128, 8),
    ]
    shapes = [ModelShape("gpt2", 2, 128, 4, 4096, 64, 8)] if args.quick else shapes
    for shape in shapes:
        print(bench(shape, steps, rounds, root), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
