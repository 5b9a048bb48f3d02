"""Fidelity of dattri_llm's capture on OLMo-core training runs: one command, markdown tables.

A tiny OLMo-2-style model is trained by OLMo-core's stock ``TransformerTrainModule`` +
``Trainer.fit()`` (two micro-batches per step) with ``GradientCaptureCallback`` attached:
exactness of every stored per-sample gradient against one-sample ``backward()`` at that step's
weights (untied head, tied head, norms with a bias), coverage (parameters captured, warnings,
``fit()``'s dry run kept out of the store) and overhead (median step with capture in memory /
offloaded over the same run without hooks). Exits non-zero when a check fails. Needs the
``olmo-core`` extra (its own environment)::

    OMP_NUM_THREADS=1 python -m experiments.fidelity.run [--quick] [--json PATH]
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, subsets and repeats")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--out", default=None, help="keep the run directories here")
    parser.add_argument("--parts", default="exactness,overhead", help="a comma-separated subset")
    opts = parser.parse_args(argv)
    parts = set(opts.parts.split(","))
    from importlib import metadata

    mode = "quick" if opts.quick else "full"
    extra = {"ai2-olmo-core": metadata.version("ai2-olmo-core"), "mode": mode}
    print(header("dattri_llm capture fidelity on OLMo-core", extra))
    with tempfile.TemporaryDirectory(prefix="dattri_llm_fidelity_") as tmp:
        work = Path(opts.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results = run(work, parts, quick=opts.quick)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=2, default=str))
    for f in results["failures"]:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if results["failures"] else 0


def run(work: Path, parts: set[str], quick: bool) -> dict:
    from olmo_core.optim import AdamWConfig

    from experiments.fidelity import checks
    from experiments.fidelity.training import build_model, make_data, model_config, train_to_store

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
            run_, store = train_to_store(work, f"exact_{variant}", data, model, batch=batch,
                                         micro_batch=micro, steps=steps, snapshot=True,
                                         optim=AdamWConfig(lr=1e-2))  # fmt: skip
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
        kw = {"steps": 4 if quick else 8, "repeats": 1 if quick else 3, "batch": batch}
        for d in sizes:
            name = "olmo2_1M" if d is None else f"d_model={d}"
            ovh[name] = checks.overhead(work, data, "untied", d_model=d, micro_batch=micro, **kw)
        results["overhead"] = ovh
        print(overhead_table(ovh, batch, micro))
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


if __name__ == "__main__":
    sys.exit(main())
