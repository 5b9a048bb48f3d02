"""Capture-core speed: a plain training step against the same step under ``HookManager``
(factorized / materialized / auto capture), the bytes each keeps, and the per-sample Gram of the
batch by hooks + ``pairwise_dot``, ``torch.func`` vmap and Opacus, each against a float64 vmap
Gram, with peak memory (GPT-2 6x512, Llama 4x256; random weights, CPU). Opacus runs in the same
process when ``experiments/benchmark/.venv-opacus`` exists (the script re-executes itself there).

    OMP_NUM_THREADS=1 python experiments/benchmark/capture.py [--quick] [--no-opacus]
"""

# ruff: noqa: E402  (torch is imported after the re-execution with one thread)
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env

OPACUS_PY = os.path.join(BENCH_DIR, ".venv-opacus", "bin", "python")
p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--quick", action="store_true", help="small shapes, 2 rounds")
p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
p.add_argument("--no-opacus", action="store_true", help="skip Opacus")
ARGS = p.parse_args()
if __name__ == "__main__":
    ensure_env(OPACUS_PY if (not ARGS.no_opacus and os.path.exists(OPACUS_PY)) else None)

import torch
from utils.env import header
from utils.memory import memory_method_ok
from utils.models import ModelShape, batch_loss, build_model, describe, hook_config, make_batch
from utils.reference import flat_gram, rel_err, vmap_per_sample_grads
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table
from utils.timing import Variant, paired_ratio, time_interleaved

from dattri_llm import CaptureCallback, HookManager
from dattri_llm.gradient import ops

STYLES = ("factorized", "materialized", "auto")
TARGETS = {"hook factorized": 1.05, "hook materialized": 1.25}
OURS, VMAP, OPACUS = "Gram: hook + pairwise_dot", "Gram: vmap + GEMM", "Gram: Opacus + GEMM"


def log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


class Hooked:
    """A training step under a ``HookManager``; the hooks are set up and removed untimed."""

    def __init__(self, model: torch.nn.Module, style: str) -> None:
        self.model, self.config = model, hook_config(model, capture_style=style)
        self.cb, self.hm = CaptureCallback(), None

    def setup(self) -> None:
        self.hm = HookManager(self.model, config=self.config, callbacks=[self.cb])

    def teardown(self) -> None:
        self.hm.remove()

    def __call__(self, ids: torch.Tensor) -> object:
        self.model.zero_grad(set_to_none=True)
        with self.hm.collect():
            batch_loss(self.model, ids).backward()
        return self.cb.pop()


def opacus_variant(model: torch.nn.Module, ids: torch.Tensor, grams: dict, kept: dict) -> Variant:
    """Opacus ``GradSampleModule`` (sum reduction) per-sample gradients and their Gram."""
    box: dict = {}
    b = ids.shape[0]

    def setup() -> None:
        from opacus import GradSampleModule

        box["gsm"] = GradSampleModule(model, batch_first=True, loss_reduction="sum")

    def per_sample() -> list[torch.Tensor]:
        gs = (getattr(prm, "grad_sample", None) for prm in model.parameters())
        return [g for g in gs if g is not None]

    def gram() -> torch.Tensor:
        for prm in model.parameters():
            prm.grad = prm.grad_sample = None
        batch_loss(box["gsm"], ids).backward()
        flats = [g.reshape(g.shape[0], -1) for g in per_sample()]
        # a grad_sample without a per-sample axis (GPT-2's wpe, fed an un-batched position
        # index: batch-summed) counts for every sample, which is what a user gets
        flats = [f if f.shape[0] == b else f.sum(0, keepdim=True).expand(b, -1) for f in flats]
        return sum(f @ f.T for f in flats)

    def after(out: torch.Tensor) -> None:
        grams[OPACUS], kept[OPACUS] = out, sum(g.nbytes for g in per_sample())

    def teardown() -> None:
        box.pop("gsm")._close()
        model.zero_grad(set_to_none=True)

    return Variant(OPACUS, gram, setup, teardown, after)


def bench_model(shape: ModelShape, rounds: int, use_opacus: bool) -> str:
    model, ids = build_model(shape), make_batch(shape)
    b, n_params = shape.batch, sum(p.numel() for p in model.parameters())
    log(f"model {describe(shape, model)}")
    kept: dict[str, int | None] = {"plain step": 0, VMAP: b * n_params * 4}
    grams: dict[str, torch.Tensor] = {}

    def plain_step() -> None:
        model.zero_grad(set_to_none=True)
        batch_loss(model, ids).backward()

    def keep_record(name: str) -> object:
        def after(rec: object) -> None:
            kept[name], grams[name] = rec.gradient.nbytes, ops.pairwise_dot(rec.gradient)

        return after

    def keep_gram(name: str) -> object:
        return lambda out: grams.__setitem__(name, out)

    variants = [Variant("plain step", plain_step)]
    for s in STYLES:
        h = Hooked(model, s)
        variants.append(Variant(f"hook {s}", lambda h=h: h(ids), h.setup, h.teardown,
                                keep_record(f"hook {s}")))  # fmt: skip
    g = Hooked(model, "factorized")
    ours_gram = lambda: ops.pairwise_dot(g(ids).gradient)  # noqa: E731
    variants.append(Variant(OURS, ours_gram, g.setup, g.teardown, keep_gram(OURS)))
    vmap_gram = lambda: flat_gram(vmap_per_sample_grads(model, ids))  # noqa: E731
    variants.append(Variant(VMAP, vmap_gram, after=keep_gram(VMAP)))
    if use_opacus:
        variants.append(opacus_variant(model, ids, grams, kept))
    timings = time_interleaved(variants, rounds=rounds, warmup=1, log=log)
    peaks = {name: max(t.peaks) for name, t in timings.items()}
    kept[OURS] = kept.get("hook factorized")

    # the Gram contraction alone, on a kept factorized record
    g.setup()
    rec = g(ids)
    g.teardown()
    dot = Variant("pairwise_dot", lambda: ops.pairwise_dot(rec.gradient))
    dot_t = time_interleaved([dot], rounds=1, warmup=0)["pairwise_dot"].cpu_median

    log("float64 vmap reference Gram")
    model64 = build_model(shape, dtype=torch.float64)
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref = flat_gram(vmap_per_sample_grads(model64, ids))
    del model64

    base, g_ours = timings["plain step"], timings[OURS]
    rows, grows = [], []
    for v in variants:
        t, name = timings[v.name], v.name
        ratio = paired_ratio(t, base, cpu=True)
        err = f"{rel_err(grams[name], ref):.1e}" if name in grams else ""
        mem = [fmt_bytes(peaks[name]), fmt_bytes(kept.get(name)), err]
        if not name.startswith("Gram:"):
            target = TARGETS.get(name)
            mark = f"<= {target:.2f}x: {'met' if ratio <= target else 'MISSED'}" if target else ""
            times = [fmt_s(t.cpu_median), fmt_s(t.median), fmt_x(ratio)]
            rows.append([name, *times, fmt_x(paired_ratio(t, base)), mark, *mem])
            continue
        speed = paired_ratio(t, g_ours, cpu=True)
        target = f">= 3x: {'met' if speed >= 3 else 'MISSED'}" if name == VMAP else ""
        times = [fmt_s(t.cpu_median), fmt_s(t.median), fmt_x(ratio), fmt_x(speed)]
        grows.append([name, *times, fmt_x(paired_ratio(t, g_ours)), target, *mem])
    heads = "variant|CPU time (median)|wall (median)|ratio vs plain (CPU)|ratio (wall)|"
    heads += "target (CPU ratio)|peak memory|bytes kept / step|Gram rel. err vs f64"
    out = [f"### {describe(shape, model)}\n", md_table(heads, rows)]
    out.append(
        "\nPer-sample gradients without a Gram: the Gram rows below (an 8x8 GEMM on top of "
        f"them is negligible); they keep B x P x 4 bytes ({fmt_bytes(b * n_params * 4)}).\n"
        f"\nPer-sample Gram of the batch ({b}x{b}); `pairwise_dot` alone on a kept "
        f"factorized record (one call): {fmt_s(dot_t)} CPU.\n"
    )
    heads = "method|CPU time (median)|wall (median)|ratio vs plain step (CPU)|time / ours (CPU)|"
    heads += "time / ours (wall)|target (CPU)|peak memory|bytes kept|max rel. err vs f64 vmap"
    out.append(md_table(heads, grows))
    if use_opacus and shape.family == "gpt2":
        out.append(
            "\nOpacus gives GPT-2's `wpe` (fed an un-batched position index) one batch-summed "
            "`grad_sample`; its Gram counts that sum for every sample, which is the error shown.\n"
        )
    return "\n".join(out)


def main() -> None:
    rounds = ARGS.rounds or (2 if ARGS.quick else 3)
    use_opacus = not ARGS.no_opacus and importlib.util.find_spec("opacus") is not None
    ok, mb = memory_method_ok()
    extra = {
        "rounds": f"{rounds} interleaved rounds after 1 warm-up call per variant; ratio = "
        "median over rounds of the per-round ratio; CPU = process CPU time (steadier than "
        "wall clock on this loaded machine; targets are judged on it)",
        "peak memory": "max over the timed calls of the resident-set high-water mark above the "
        f"level before the call (utils/memory.py); self-check with a transient 100 MB tensor "
        f"read {mb:.1f} MB" + ("" if ok else " (CHECK FAILED: memory figures unreliable)"),
        "loss": "sum over samples of each sample's mean next-token loss; dropout off",
        "Opacus": "in the same process (.venv-opacus)" if use_opacus else "not available",
        "exactness": "max |G - G_ref| / max |G_ref| against a float64 torch.func vmap Gram",
    }
    print(header("Capture benchmark", extra))
    if ARGS.quick:
        shapes = [ModelShape(f, 2, 128, 4, 4096, 64, 4) for f in ("gpt2", "llama")]
    else:
        shapes = [ModelShape("gpt2", 6, 512, 8, 50257, 128, 8),
                  ModelShape("llama", 4, 256, 4, 32000, 128, 8, intermediate=688)]  # fmt: skip
    for shape in shapes:
        print(bench_model(shape, rounds, use_opacus), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
