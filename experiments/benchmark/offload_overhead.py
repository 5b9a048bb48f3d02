"""Offload overhead: training steps (zero grads, forward, loss, backward, ``AdamW``; GPT-2 from
config) plain, under ``HookManager`` (factorized) with a callback that drops each record, and
with ``OffloadCallback`` into a fresh store, asynchronous (the default) and synchronous. Each
run is ``--steps`` steps in one collection context (the async writer overlaps the next steps)
ending with the store's flush, all timed; reported per step. Target: offload <= 1.10x plain.
``--kronecker`` times, instead of the stores, the step with ``KroneckerCovarianceCallback``
(K-FAC's sums of ``a aᵀ`` and ``g gᵀ`` per layer) on GPT-2 6x512 and Llama 4x256 (head not
hooked: its ``G`` would be vocab²). The first step of each hooked run (a one-time coverage
check) is untimed.

    OMP_NUM_THREADS=1 python experiments/benchmark/offload_overhead.py [--quick] [--kronecker]
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
from dattri_llm.gradient.callbacks import KroneckerCovarianceCallback

NAMES = {
    "plain": "plain training step",
    "hook": "hook factorized (record dropped)",
    "offload async": "hook + OffloadCallback (async writer)",
    "offload sync": "hook + OffloadCallback (sync writes)",
    "kronecker": "hook + KroneckerCovarianceCallback",
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
        self.exclude, self.kron = None, None  # exclude: a tuple in --kronecker mode

    def setup(self) -> None:
        if self.kind == "plain":
            return
        if self.kind == "hook":
            cbs = [CaptureCallback()]
        elif self.kind == "kronecker":
            self.kron = KroneckerCovarianceCallback()
            cbs = [CaptureCallback(), self.kron]
        else:
            self.dir = tempfile.mkdtemp(prefix="offload-", dir=self.root)
            store_dir, is_async = os.path.join(self.dir, "store"), self.kind == "offload async"
            self.store = GradientStorageManager(store_dir, async_write=is_async)
            cbs = [OffloadCallback(offload_interval=1, file_manager=self.store,
                                   recording_type="per_sample")]  # fmt: skip
        self.hm = HookManager(self.model, hook_config(self.model, exclude=self.exclude or ()), cbs)
        self(self.batches[:1])  # untimed: the first step's one-time coverage check (~2x a step)

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

    def __call__(self, batches: list[torch.Tensor] | None = None) -> None:
        with self.hm.collect() if self.hm else contextlib.nullcontext():  # exit: store flushed
            for ids in batches or self.batches:
                self.opt.zero_grad(set_to_none=True)
                batch_loss(self.model, ids).backward()
                self.opt.step()


def check_kronecker(model: torch.nn.Module, run: Run, ids: torch.Tensor) -> str:
    """One step's sums of the first MLP layer vs float64 ones over the tokens the loss reaches."""
    run.setup()
    name = next(n for n in run.kron.covariances.layers if ".mlp." in n)
    mod, seen = model.get_submodule(name), {}
    run.kron.covariances.layers.clear()  # the sums of one step only
    keep = lambda _m, i, o: seen.update(a=i[0].detach(), o=o) or o.retain_grad()  # noqa: E731
    handle = mod.register_forward_hook(keep)
    with run.hm.collect():
        batch_loss(model, ids).backward()
    handle.remove()
    run.teardown()
    a, g = (t[:, :-1].double().flatten(0, 1) for t in (seen["a"], seen["o"].grad))  # torch hooks
    a = torch.cat([a, a.new_ones(len(a), 1)], 1) if mod.bias is not None else a  # bias column
    cov = run.kron.covariances.layers[name]
    err = [float((s - r.T @ r).abs().max() / (r.T @ r).abs().max())
           for s, r in ((cov.a_sum, a), (cov.g_sum, g))]  # fmt: skip
    return (f"{name}: max |sum - float64 sum| / max |float64 sum|: A {err[0]:.1e}, G "
            f"{err[1]:.1e}; tokens {cov.num_tokens:.0f} of {ids.numel()}")  # fmt: skip


def bench(shape: ModelShape, steps: int, rounds: int, root: str, kron: bool = False) -> str:
    model = build_model(shape)
    batches = [make_batch(shape, seed=s) for s in range(steps)]
    kinds = ("plain", "hook", "kronecker") if kron else tuple(NAMES)[:-1]
    runs = {k: Run(model, batches, k, root) for k in kinds}
    for r in runs.values():  # an untied vocabulary head's G (vocab x vocab) is out of reach
        r.exclude = None if not kron else ("lm_head",) if shape.family == "llama" else ()
    head = f"### {describe(shape, model)}, {steps} steps per run, AdamW\n\n"
    if kron:
        check = check_kronecker(model, runs["kronecker"], batches[0])
        head += f"Sums checked: {check}\n\n"
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
        if r.kron is not None:  # the float64 sums A and G held, and the spread of the rounds
            held = sum(c.a_sum.nbytes + c.g_sum.nbytes for c in r.kron.covariances.layers.values())
            ratios = sorted(x / y for x, y in zip(tv.cpu, base.cpu))
            written = f"{fmt_bytes(held)} held (CPU {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
        if r.bytes_written:
            per_step = r.bytes_written / (steps + 1)  # the untimed first step wrote one too
            written, rate = fmt_bytes(per_step), f"{per_step * steps / 1e6 / tv.median:.0f} MB/s"
        times = [fmt_s(tv.median / steps), fmt_s(tv.cpu_median / steps)]
        rows.append([NAMES[k], *times, fmt_x(ratio), fmt_x(cpu_ratio), target, written, rate])
    return head + md_table(
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
    p.add_argument("--kronecker", action="store_true", help="K-FAC statistics, not the stores")
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 7 if args.kronecker else 3)
    steps = args.steps or (4 if args.quick else 2 if args.kronecker else 6)
    root = args.dir or tempfile.gettempdir()
    store = f"fresh GradientStorageManager per run under {root} (same disk as the repo), "
    store += "deleted after; default options (fsync on, CRC-32, max_pending=1)"
    timing = f"{rounds} interleaved rounds of {steps} steps after a warm-up run; the run's "
    timing += "closing flush is inside the timed region"
    store = "none: the callback's sums, in memory" if args.kronecker else store
    print(header("Offload overhead", {"store": store, "timing": timing}))
    quick = [(f, 2, 128, 4, 4096, 64, 8) for f in ("gpt2", "llama")[: 1 + args.kronecker]]
    sizes = [("gpt2", 4, 256, 4, 50257, 64, 8), ("gpt2", 6, 512, 8, 50257, 128, 8)]
    if args.kronecker:  # the capture table's shapes
        sizes = [("gpt2", 6, 512, 8, 50257, 128, 8), ("llama", 4, 256, 4, 32000, 128, 8, 688)]
    for size in quick if args.quick else sizes:
        print(bench(ModelShape(*size), steps, rounds, root, args.kronecker), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
