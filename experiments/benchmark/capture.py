"""Capture-core speed benchmark: hooked capture vs a plain training step.

For a GPT-2-shaped and a tiny Llama model built from configs (random weights, CPU), measures in
one process run:

* a plain training step (zero grads, forward, loss, backward);
* the same step under ``HookManager`` + ``CaptureCallback`` in each capture style
  (``factorized``, ``materialized``, ``auto``), and the bytes each keeps per step;
* per-sample gradients by ``torch.func`` ``vmap(grad)`` and by Opacus ``GradSampleModule``
  (when ``experiments/benchmark/.venv-opacus`` exists, the script re-executes itself there);
* the per-sample Gram of the batch: hooked step + ``ops.pairwise_dot`` vs vmap + GEMM vs
  Opacus + GEMM, each compared with a float64 ``vmap`` reference;
* the peak memory of each (see ``utils/memory.py``).

Targets: factorized <= 1.05x the plain step, materialized <= 1.25x, hooked Gram
>= 3x faster than the vmap reference at equal exactness.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env  # noqa: E402

OPACUS_PY = os.path.join(BENCH_DIR, ".venv-opacus", "bin", "python")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 2 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    p.add_argument("--models", default="gpt2,llama", help="comma list of gpt2, llama")
    p.add_argument("--no-opacus", action="store_true", help="skip Opacus")
    p.add_argument("--no-ref64", action="store_true", help="skip the float64 reference Gram")
    return p.parse_args()


ARGS = parse_args()
if __name__ == "__main__":
    ensure_env(OPACUS_PY if (not ARGS.no_opacus and os.path.exists(OPACUS_PY)) else None)

import torch  # noqa: E402
from utils.adapters import run_opacus  # noqa: E402
from utils.adapters.run_ours import HookedStep  # noqa: E402
from utils.env import header  # noqa: E402
from utils.memory import memory_method_ok  # noqa: E402
from utils.models import (  # noqa: E402
    ModelShape,
    batch_loss,
    build_model,
    describe,
    hook_config,
    make_batch,
)
from utils.reference import flat_gram, rel_err, vmap_per_sample_grads  # noqa: E402
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table  # noqa: E402
from utils.timing import Variant, paired_ratio, time_interleaved  # noqa: E402

from dattri_llm.gradient import ops  # noqa: E402

STYLES = ("factorized", "materialized", "auto")
TARGETS = {"hook factorized": 1.05, "hook materialized": 1.25}


def log(msg: str) -> None:
    print(f"[capture] {msg}", file=sys.stderr, flush=True)


def shapes(quick: bool, which: list[str]) -> list[ModelShape]:
    table = {
        "gpt2": ModelShape("gpt2", 2, 128, 4, 4096, 64, 4),
        "llama": ModelShape("llama", 2, 128, 4, 4096, 64, 4),
    }
    if not quick:
        table = {
            "gpt2": ModelShape("gpt2", 6, 512, 8, 50257, 128, 8),
            "llama": ModelShape("llama", 4, 256, 4, 32000, 128, 8, intermediate=688),
        }
    return [table[w] for w in which]


def plain_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    batch_loss(model, ids).backward()


def bench_model(shape: ModelShape, rounds: int, use_opacus: bool, ref64: bool) -> str:
    model = build_model(shape)
    ids = make_batch(shape)
    b = shape.batch
    log(f"model {describe(shape, model)}")
    hooked = {s: HookedStep(model, batch_loss, hook_config(model, capture_style=s)) for s in STYLES}
    gram_step = HookedStep(model, batch_loss, hook_config(model, capture_style="factorized"))
    state: dict[str, object] = {}

    def ours_gram() -> torch.Tensor:
        rec = gram_step(ids)
        return ops.pairwise_dot(rec.gradient)

    def vmap_gram() -> torch.Tensor:
        return flat_gram(vmap_per_sample_grads(model, ids))

    n_params = sum(p.numel() for p in model.parameters())
    kept: dict[str, int | None] = {"plain step": 0}
    grams: dict[str, torch.Tensor] = {}

    def keep_record(name: str, h: HookedStep) -> object:
        def after(_: object) -> None:
            kept[name] = h.record.gradient.nbytes
            grams[name] = ops.pairwise_dot(h.record.gradient)

        return after

    def keep_gram(name: str) -> object:
        def after(out: torch.Tensor) -> None:
            grams[name] = out

        return after

    variants = [Variant("plain step", lambda: plain_step(model, ids))]
    for s in STYLES:
        h = hooked[s]
        name = f"hook {s}"
        variants.append(
            Variant(name, lambda h=h: h(ids), h.setup, h.teardown, keep_record(name, h))
        )
    ours_name = "Gram: hook + pairwise_dot"
    after = keep_gram(ours_name)
    variants.append(Variant(ours_name, ours_gram, gram_step.setup, gram_step.teardown, after))
    variants.append(Variant("Gram: vmap + GEMM", vmap_gram, after=keep_gram("Gram: vmap + GEMM")))
    kept["Gram: vmap + GEMM"] = b * n_params * 4
    if use_opacus:

        def op_setup() -> None:
            state["op"] = run_opacus.OpacusStep(model, batch_loss)

        def op_teardown() -> None:
            state.pop("op").remove()
            model.zero_grad(set_to_none=True)

        def op_gram() -> torch.Tensor:
            op = state["op"]
            op(ids)
            return op.gram(b)

        def op_after(out: torch.Tensor) -> None:
            grams["Gram: Opacus + GEMM"] = out
            kept["Gram: Opacus + GEMM"] = sum(t.nbytes for t in state["op"].per_sample().values())

        variants.append(Variant("Gram: Opacus + GEMM", op_gram, op_setup, op_teardown, op_after))

    timings = time_interleaved(variants, rounds=rounds, warmup=1, log=log)
    peaks = {name: max(t.peaks) for name, t in timings.items()}
    kept["Gram: hook + pairwise_dot"] = kept.get("hook factorized")

    # time of the Gram contraction alone, from a kept factorized record
    h = HookedStep(model, batch_loss, hook_config(model, capture_style="factorized"))
    h.setup()
    rec = h(ids)
    h.teardown()
    dot_t = time_interleaved(
        [Variant("pairwise_dot", lambda: ops.pairwise_dot(rec.gradient))], rounds=1, warmup=0
    )["pairwise_dot"].cpu_median

    ref = None
    if ref64:
        log("float64 vmap reference Gram")
        model64 = build_model(shape, dtype=torch.float64)
        model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
        ref = flat_gram(vmap_per_sample_grads(model64, ids))
        del model64

    base = timings["plain step"]
    rows = []
    for v in variants:
        if v.name.startswith("Gram:"):
            continue
        t = timings[v.name]
        ratio = paired_ratio(t, base, cpu=True)
        wall_ratio = paired_ratio(t, base)
        target = TARGETS.get(v.name)
        verdict = (
            "" if target is None else f"<= {target:.2f}x: {'met' if ratio <= target else 'MISSED'}"
        )
        err = f"{rel_err(grams[v.name], ref):.1e}" if ref is not None and v.name in grams else ""
        times = [fmt_s(t.cpu_median), fmt_s(t.median), fmt_x(ratio), fmt_x(wall_ratio), verdict]
        rows.append([v.name, *times, fmt_bytes(peaks[v.name]), fmt_bytes(kept.get(v.name)), err])
    heads = "variant|CPU time (median)|wall (median)|ratio vs plain (CPU)|ratio (wall)|"
    heads += "target (CPU ratio)|peak memory|bytes kept / step|Gram rel. err vs f64"
    out = [f"### {describe(shape, model)}\n", md_table(heads.split("|"), rows)]
    out.append(
        "\nPer-sample gradients without a Gram: the Gram rows below (an 8x8 GEMM on "
        "top of them is negligible); they keep B x P x 4 bytes "
        f"({fmt_bytes(b * n_params * 4)}).\n"
    )
    g_ours = timings["Gram: hook + pairwise_dot"]
    grows = []
    for name in [v.name for v in variants if v.name.startswith("Gram:")]:
        t = timings[name]
        speed = paired_ratio(t, g_ours, cpu=True)
        err = f"{rel_err(grams[name], ref):.1e}" if ref is not None else "n/a"
        target = ""
        if name == "Gram: vmap + GEMM":
            target = f">= 3x: {'met' if speed >= 3 else 'MISSED'}"
        times = [fmt_s(t.cpu_median), fmt_s(t.median), fmt_x(paired_ratio(t, base, cpu=True))]
        times += [fmt_x(speed), fmt_x(paired_ratio(t, g_ours)), target]
        grows.append([name, *times, fmt_bytes(peaks[name]), fmt_bytes(kept.get(name)), err])
    out.append(
        f"\nPer-sample Gram of the batch ({b}x{b}); `pairwise_dot` alone on a kept "
        f"factorized record (one call): {fmt_s(dot_t)} CPU.\n"
    )
    heads = "method|CPU time (median)|wall (median)|ratio vs plain step (CPU)|time / ours (CPU)|"
    heads += "time / ours (wall)|target (CPU)|peak memory|bytes kept|max rel. err vs f64 vmap"
    out.append(md_table(heads.split("|"), grows))
    if use_opacus and shape.family == "gpt2":
        out.append(
            "\nOpacus gives GPT-2's `wpe` (fed an un-batched position index) one "
            "batch-summed `grad_sample`; its Gram counts that sum for every sample, which "
            "is the error shown.\n"
        )
    return "\n".join(out)


def main() -> None:
    rounds = ARGS.rounds or (2 if ARGS.quick else 3)
    use_opacus = not ARGS.no_opacus and run_opacus.available()
    ok, mb = memory_method_ok()
    extra = {
        "rounds": f"{rounds} interleaved rounds after 1 warm-up call per variant; ratio = "
        "median over rounds of the per-round ratio; CPU = process CPU time (steadier "
        "than wall clock on this loaded machine; targets are judged on it)",
        "peak memory": "max over the timed calls of the resident-set high-water mark above the "
        "level before the call "
        "(/proc/self/clear_refs reset + VmHWM, after malloc_trim); self-check "
        f"with a transient 100 MB tensor read {mb:.1f} MB"
        + ("" if ok else " (CHECK FAILED: memory figures unreliable)"),
        "loss": "sum over samples of each sample's mean next-token loss; dropout off",
        "Opacus": "in the same process (.venv-opacus)" if use_opacus else "not available",
        "exactness": "max |G - G_ref| / max |G_ref| against a float64 torch.func vmap Gram"
        if not ARGS.no_ref64
        else "float64 reference skipped",
    }
    print(header("Capture benchmark", extra))
    for shape in shapes(ARGS.quick, ARGS.models.split(",")):
        print(bench_model(shape, rounds, use_opacus, not ARGS.no_ref64), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
