"""Rows added by a later run against the combined result's rows, on the seeds they share.

A ``--rows`` run (``run.py --seeds S --tag T --rows ...``) writes its own per-seed files; this
merges their rows into the same seeds of a combined result (default ``results/tracing.json``)
in memory and prints the rows' means and the paired differences (per seed x fact, 95 %
intervals as in :mod:`.report`), without rewriting the combined result.

    python -m experiments.benchmark.tracing.compare results/tracing-dense-s{0,1,2,3,4}.json \\
        --pairs "ROW A" "ROW B" ...   # A − B, then the next two, ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from experiments.benchmark.tracing import report
from experiments.benchmark.utils.env import RESULTS_DIR

RESULTS = RESULTS_DIR


def merged(base: dict[str, Any], extra: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds of ``extra``, each with ``base``'s rows of that seed plus its own."""
    by_seed = {s["seed"]: s for s in base["seeds"]}
    seeds = []
    for part in extra:
        for s in part["seeds"]:
            seeds.append({"seed": s["seed"], "rows": {**by_seed[s["seed"]]["rows"], **s["rows"]}})
    return {"seeds": seeds}


def tables(result: dict[str, Any], pairs: list[str]) -> str:
    """Means of every row named in ``pairs``, then each pair's paired difference."""
    rows = list(dict.fromkeys(pairs))
    keys = ("recall@10", "mrr", "causal_drop")
    lines = [
        f"seeds {[s['seed'] for s in result['seeds']]}",
        "",
        "| row | recall@10 | MRR | causal drop (nats) | score s | peak MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [report._cell(report.pooled(result, r, k)) for k in keys]
        secs = np.mean([s["rows"][r].get("score_s", np.nan) for s in result["seeds"]])
        peak = np.mean([s["rows"][r].get("peak_mb", np.nan) for s in result["seeds"]])
        lines.append(f"| {r} | " + " | ".join(cells) + f" | {secs:.1f} | {peak:.0f} |")
    lines += ["", "| paired per (seed, fact) | recall@10 | MRR | causal drop |"]
    lines.append("|---|---|---|---|")
    for a, b in zip(pairs[::2], pairs[1::2]):
        cells = ["{:+.3f} ± {:.3f}".format(*report.paired(result, a, b, k)) for k in keys]
        lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extra", nargs="+", help="per-seed result files of the added rows")
    parser.add_argument("--base", default=str(RESULTS / "tracing.json"))
    parser.add_argument("--pairs", nargs="+", required=True, help="row names, A B A B ...")
    ns = parser.parse_args(argv)
    if len(ns.pairs) % 2:
        raise SystemExit("--pairs: give row names in pairs (A B: the difference A − B).")
    base = json.loads(Path(ns.base).read_text())
    extra = [json.loads(Path(p).read_text()) for p in ns.extra]
    print(tables(merged(base, extra), ns.pairs))


if __name__ == "__main__":
    main()
