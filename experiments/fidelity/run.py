"""Fidelity of dattri_llm's capture on OLMo-core training runs: one command, markdown tables.

A tiny OLMo-2-style model (reordered-norm blocks, QK-norms, SwiGLU, RoPE, RMS norms) is trained
by OLMo-core's stock ``TransformerTrainModule`` + ``Trainer.fit()`` on byte-level windows of
Python's documentation topics, two micro-batches per step, with dattri_llm attached through
``dattri_llm.integrations.olmo_core.GradientCaptureCallback``. Reported:

1. exactness: every stored per-sample gradient, of every layer and every step, against
   one-sample ``backward()`` at that step's weights (max relative error per layer role), for an
   untied head, a tied head (``tie_word_embeddings``) and norms with a bias;
2. coverage: trainable parameters captured, dattri_llm warnings, and that ``fit()``'s dry-run
   batch never reached the store;
3. overhead: median step time with capture (in memory / offloaded to a store) over the same
   run without hooks;
4. attribution quality: LDS of TracIn and DVEmb on an SGD run against masked retraining (the
   same run with half the windows masked out of their batches), over learning rates.

Needs the ``olmo-core`` extra (its own virtual environment)::

    OMP_NUM_THREADS=1 python -m experiments.fidelity.run [--quick] [--json PATH]

Exits non-zero when a check fails: a relative error above 1e-5, a trainable parameter not
captured, a dattri_llm warning, a stored dry-run sample or step, or an LDS below 0.9 at the
smallest learning rate (first-order regime; measured 0.98-0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# one thread, set before torch is imported (two make timings erratic on 2-core machines)
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # also runnable as ``python experiments/fidelity/run.py``
    sys.path.insert(0, str(ROOT))

from experiments.benchmark.utils.env import header  # noqa: E402
from experiments.benchmark.utils.table import md_table  # noqa: E402

VARIANTS = ("untied", "tied", "norm-bias")
TOLERANCE = 1e-5  # relative, float32 training (the measured errors are 0 on this CPU)
LDS_LR = 0.001  # first-order regime: the methods should predict masked retraining closely
LDS_MIN = 0.9  # measured 0.97-0.99 there


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, subsets and repeats")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--out", default=None, help="keep the run directories here")
    parser.add_argument(
        "--parts",
        default="exactness,overhead,quality",
        help="comma-separated subset of exactness, overhead, quality",
    )
    opts = parser.parse_args(argv)
    parts = set(opts.parts.split(","))
    from importlib import metadata

    print(
        header(
            "dattri_llm capture fidelity on OLMo-core",
            {
                "ai2-olmo-core": metadata.version("ai2-olmo-core"),
                "mode": "quick" if opts.quick else "full",
            },
        )
    )
    with tempfile.TemporaryDirectory(prefix="dattri_llm_fidelity_") as tmp:
        work = Path(opts.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run(work, parts, quick=opts.quick)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2, default=str))
    failures = results.get("failures", [])
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


def run(work: Path, parts: set[str], quick: bool) -> dict:
    from olmo_core.optim import AdamWConfig

    from experiments.fidelity import checks
    from experiments.fidelity.training import (
        build_model,
        make_data,
        model_config,
        train_to_store,
    )

    results: dict = {"failures": []}
    batch, micro = 8, 4
    if "exactness" in parts:
        steps = 2 if quick else 4
        data = make_data(work, per_topic=4 if quick else 8)
        exact: dict[str, dict[str, float]] = {}
        cover: dict[str, dict] = {}
        for variant in VARIANTS:
            cfg = model_config(variant)
            model = build_model(cfg)
            run_, store = train_to_store(
                work,
                f"exact_{variant}",
                data,
                model,
                batch=batch,
                micro_batch=micro,
                steps=steps,
                optim=AdamWConfig(lr=1e-2),
                snapshot=True,
            )
            exact[variant] = checks.exactness(store, run_, cfg, data)
            cover[variant] = checks.coverage(run_, data, store)
            worst = max(exact[variant].values())
            if worst > TOLERANCE:
                results["failures"].append(f"{variant}: max relative error {worst:.2e}")
            c = cover[variant]
            if c["missing"] or c["warnings"] or c["foreign_samples"]:
                results["failures"].append(f"{variant}: coverage {c}")
            if c["stored_steps"] != c["real_steps"] or c["first_step"] != 1:
                results["failures"].append(f"{variant}: steps {c}")
        results["exactness"], results["coverage"] = exact, cover
        print(exactness_table(exact, steps, batch, micro))
        print(coverage_table(cover))
    if "overhead" in parts:
        data = make_data(work, per_topic=8)
        sizes = [None] if quick else [None, 128]
        ovh = {}
        for d in sizes:
            ovh["olmo2_1M" if d is None else f"d_model={d}"] = checks.overhead(
                work,
                data,
                "untied",
                d_model=d,
                steps=4 if quick else 8,
                repeats=1 if quick else 3,
                batch=batch,
                micro_batch=micro,
            )
        results["overhead"] = ovh
        print(overhead_table(ovh, batch, micro))
    if "quality" in parts:
        per_topic = 4 if quick else 8  # one epoch: steps * batch windows
        data = make_data(work, per_topic=per_topic, queries_per_topic=2)
        steps = len(data.windows) // batch
        quality = [
            checks.attribution_quality(
                work,
                data,
                steps=steps,
                batch=batch,
                micro_batch=micro,
                lr=lr,
                subsets=8 if quick else 32,
            )
            for lr in ((LDS_LR,) if quick else (LDS_LR, 0.01, 0.1))
        ]
        results["quality"] = quality
        print(quality_table(quality))
        small = quality[0]["lds"]
        for name in ("TracIn", "DVEmb"):
            if small[name] < LDS_MIN:
                results["failures"].append(
                    f"LDS of {name} at lr={LDS_LR:g} is {small[name]:.3f} < {LDS_MIN}"
                )
    return results


def exactness_table(exact: dict[str, dict[str, float]], steps: int, b: int, m: int) -> str:
    rows = sorted({k for v in exact.values() for k in v}, key=_row_order)
    cells = [[f"`{r}`", *(f"{exact[v][r]:.1e}" if r in exact[v] else "—" for v in exact)]
             for r in rows]  # fmt: skip
    return (
        f"### Exactness: stored per-sample gradients vs one-sample backward ({steps} steps x "
        f"{b} samples, {b // m} micro-batches per step; max relative error, float32)\n\n"
        + md_table(["parameter (all blocks)", *exact], cells)
    )


#: The exactness table's row order: by the block's parameter kind.
ROW_ORDER = ("embeddings", "attention.w_", "attention.q_norm", "attention.k_norm",
             "attention_norm", "feed_forward.w", "feed_forward_norm", "lm_head.norm",
             "lm_head.w_out")  # fmt: skip


def _row_order(key: str) -> tuple[int, str]:
    return next((i for i, p in enumerate(ROW_ORDER) if key.startswith(p)), 99), key


def coverage_table(cover: dict[str, dict]) -> str:
    heads = ["variant", "trainable parameters captured", "dattri_llm warnings",
             "real steps / stored steps", "capture started at trainer step",
             "samples not from the data (dry run)"]  # fmt: skip
    rows = [[v, f"{c['captured']}/{c['trainable']}", len(c["warnings"]),
             f"{c['real_steps']} / {c['stored_steps']}", c["first_step"], c["foreign_samples"]]
            for v, c in cover.items()]  # fmt: skip
    return "### Coverage\n\n" + md_table(heads, rows)


def overhead_table(ovh: dict[str, dict], b: int, m: int) -> str:
    heads = ["model", "parameters", "plain step", "capture in memory",
             "capture + offload to store", "steps timed per arm"]  # fmt: skip
    rows = [[name, f"{o['params']:,}", f"{o['plain_ms']:.1f} ms", f"{o['capture_ratio']:.2f}x",
             f"{o['offload_ratio']:.2f}x", o["steps_timed"]]
            for name, o in ovh.items()]  # fmt: skip
    return (
        f"### Overhead: median training step with capture / without hooks (batch {b}, "
        f"{b // m} micro-batches, AdamW)\n\n" + md_table(heads, rows)
    )


def quality_table(quality: list[dict]) -> str:
    q0 = quality[0]
    names = list(q0["lds"])
    rows = [[f"{q['lr']:g}", f"{q['query_loss_change']:.3g}",
             *(f"{q['lds'][n]:.3f}" for n in names)] for q in quality]  # fmt: skip
    return (
        f"### Attribution quality: LDS vs masked retraining ({q0['train']} training windows, "
        f"one epoch of {q0['steps']} SGD steps, {q0['queries']} held-out queries, "
        f"{q0['subsets']} random halves)\n\n"
        + md_table(["learning rate", "mean abs. query loss change", *names], rows)
    )


if __name__ == "__main__":
    sys.exit(main())
