"""Capture at fixed weights: ``HookManager(fixed_weights=True)`` vs an ordinary capture.

A store captured at fixed weights (every query store, a train store captured after training)
needs the per-sample gradients, not the weights' own gradients. For a Llama-style model built
from ``LlamaConfig`` (random weights, CPU, eval mode), one process measures, with the variants
interleaved within each round (median of the rounds, after a warm-up that also takes the
first-step coverage check out of the timing; process CPU time, so other load matters less):

* ``train step``: zero grads, forward, loss, backward (no hooks);
* ``+ AdamW``: the same and ``AdamW.step()``, a whole training step;
* ``ordinary``: the same step under ``HookManager`` + ``CaptureCallback``;
* ``fixed``: the same under ``HookManager(fixed_weights=True)``;

each without projection and with ``ProjectionConfig("logra", 256)`` for the whole model (an
RMS norm wider than 256 then takes ``dense`` 256, see ``nearest_projection``), and checks
that both captures give the same per-sample gradients.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env  # noqa: E402

ensure_env()  # one thread, before torch is imported

import torch  # noqa: E402
from utils.models import ModelShape, batch_loss, build_model, describe, hook_config  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 3 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; quick 3)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--smol",
        action="store_true",
        help="SmolLM-135M's shape (30 x 576, MLP 1536, vocab 49152, untied head), seq 512",
    )
    p.add_argument(
        "--llama134m",
        action="store_true",
        help="a 134M Llama (12 x 768, MLP 2048, vocab 32000, untied head), seq 512",
    )
    return p.parse_args()


def main() -> None:
    from dattri_llm import CaptureCallback, HookManager
    from dattri_llm.gradient.ops import ProjectionConfig

    args = parse_args()
    torch.set_num_threads(1)
    if args.quick:
        shape = ModelShape("llama", 2, 64, 2, 256, 64, args.batch)
    elif args.smol:
        shape = ModelShape("llama", 30, 576, 9, 49152, 512, args.batch, intermediate=1536)
    elif args.llama134m:
        shape = ModelShape("llama", 12, 768, 12, 32000, 512, args.batch, intermediate=2048)
    else:
        shape = ModelShape("llama", 4, 256, 4, 1000, 256, args.batch)
    rounds = args.rounds or (3 if args.quick else 7)
    model = build_model(shape).eval()
    ids = torch.randint(
        0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1)
    )
    print(describe(shape, model), f"threads {torch.get_num_threads()}, {rounds} rounds", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay put

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        batch_loss(model, ids).backward()

    def adamw_step() -> None:
        train_step()
        optimizer.step()

    for proj in (None, ProjectionConfig("logra", 256)):
        managers = {}
        for name, fixed in (("ordinary", False), ("fixed", True)):
            cb = CaptureCallback()
            hm = HookManager(model, hook_config(model, projection=proj), [cb], fixed_weights=fixed)
            managers[name] = (hm, cb)

        def capture(name: str, managers: dict = managers) -> object:
            hm, cb = managers[name]
            model.zero_grad(set_to_none=True)
            with hm.collect():
                batch_loss(model, ids).backward()
            return cb.pop().gradient

        variants = {
            "train step": train_step,
            "+ AdamW": adamw_step,
            "ordinary": lambda: capture("ordinary"),
            "fixed": lambda: capture("fixed"),
        }
        got = {n: capture(n) for n in ("ordinary", "fixed")}  # warm-up (and coverage check)
        adamw_step()  # also creates AdamW's state
        diff = max(
            float(
                (
                    got["fixed"].layers[k].materialize().data
                    - got["ordinary"].layers[k].materialize().data
                )
                .abs()
                .max()
            )
            for k in got["fixed"].layers
        )
        times: dict[str, list[float]] = {n: [] for n in variants}
        for _ in range(rounds):
            for n, fn in variants.items():  # interleaved: drift hits every variant alike
                t = time.process_time()  # CPU time: robust to other load on the machine
                fn()
                times[n].append(time.process_time() - t)
        for hm, _ in managers.values():
            hm.remove()
        med = {n: statistics.median(v) for n, v in times.items()}
        label = "exact" if proj is None else "whole-model logra 16x16 (norms: nearest form)"
        print(f"\n{label}: max |fixed - ordinary| = {diff:.3g}")
        for n, v in med.items():
            print(
                f"  {n:<11} {v * 1e3:8.1f} ms   {v / med['ordinary']:.2f}x ordinary   "
                f"{v / med['train step']:.2f}x train step   {v / med['+ AdamW']:.2f}x with AdamW"
            )


if __name__ == "__main__":
    main()
