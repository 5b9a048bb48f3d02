"""Markdown table of a fact-tracing result (:mod:`.run`): means with 95 % intervals.

Every per-fact value is pooled over seeds x facts; the interval is the normal approximation
``1.96 sd / sqrt(n)``. The target check compares the best gradient row with TF-IDF *paired*
per (seed, fact).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.benchmark.tracing.metrics import mean_ci

LEXICAL = "TF-IDF (scikit-learn)"
NOT_GRADIENT = {"random", LEXICAL, "carriers (ground truth)"}


def pooled(result: dict, row: str, key: str) -> list[float]:
    """One metric of one row over every (seed, fact)."""
    return [v for s in result["seeds"] for v in s["rows"][row].get(key, [])]


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    m, h = mean_ci(values)
    return f"{m:.3f} ± {h:.3f}"


def write_report(result: dict[str, Any]) -> str:
    """The results table and the issue's target check, as Markdown."""
    cfg = result["config"]
    rows = list(dict.fromkeys(r for s in result["seeds"] for r in s["rows"]))
    recall = [s["recall"] for s in result["seeds"]]
    lines = [
        f"seeds {cfg['seeds']}, {cfg['n_docs']} documents, {cfg['n_facts']} facts x "
        f"{cfg['copies']} copies, block {cfg['block']}, {cfg['epochs']} epochs; "
        f"causal groups of {cfg['group']} facts; wall {result['wall_s']:.0f} s "
        f"(OMP_NUM_THREADS={result['omp_num_threads']}, shared 2-core machine)",
        "",
        "model recall (per seed): multiple choice "
        + ", ".join(f"{r['multiple_choice']:.2f}" for r in recall)
        + "; top-1 over the vocabulary "
        + ", ".join(f"{r['top1_vocab']:.2f}" for r in recall),
        "",
        "| method | recall@10 | MRR | causal drop (nats) | docs removed / group | score s "
        "| peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        per_seed = [s["rows"][row] for s in result["seeds"]]
        errors = [p["error"] for p in per_seed if "error" in p]
        if errors:
            lines.append(f"| {row} | failed: {errors[0]} | | | | | |")
            continue
        removed = np.mean([r for p in per_seed for r in p["removed_per_group"]])
        secs = [p["score_s"] for p in per_seed if "score_s" in p]
        peaks = [p["peak_mb"] for p in per_seed if p.get("peak_mb") is not None]
        peak = f"{max(peaks):.0f}" if peaks else "not recorded"
        lines.append(
            f"| {row} | {_cell(pooled(result, row, 'recall@10'))} | "
            f"{_cell(pooled(result, row, 'mrr'))} | {_cell(pooled(result, row, 'causal_drop'))} | "
            f"{removed:.1f} | {np.mean(secs):.1f} | {peak} |"
            if secs
            else f"| {row} | — | — | {_cell(pooled(result, row, 'causal_drop'))} | "
            f"{removed:.1f} | — | — |"
        )
    failed = {r for s in result["seeds"] for r, v in s["rows"].items() if "error" in v}
    grads = [r for r in rows if r not in NOT_GRADIENT and r not in failed]
    if grads and LEXICAL in rows:
        best_c = max(grads, key=lambda r: np.mean(pooled(result, r, "causal_drop")))
        best_r = max(grads, key=lambda r: np.mean(pooled(result, r, "recall@10")))
        lex_c = np.asarray(pooled(result, LEXICAL, "causal_drop"))
        lex_r = np.asarray(pooled(result, LEXICAL, "recall@10"))
        dc = mean_ci(list(np.asarray(pooled(result, best_c, "causal_drop")) - lex_c))
        dr = mean_ci(list(np.asarray(pooled(result, best_r, "recall@10")) - lex_r))
        lines += [
            "",
            f"target check (paired per seed x fact): best causal gradient row **{best_c}** "
            f"minus TF-IDF = {dc[0]:+.3f} ± {dc[1]:.3f} nats "
            f"({'beats' if dc[0] - dc[1] > 0 else 'does not clearly beat'} TF-IDF); "
            f"best recall@10 gradient row **{best_r}** minus TF-IDF = {dr[0]:+.3f} ± {dr[1]:.3f} "
            f"({'within' if dr[0] >= -0.05 else 'not within'} 0.05).",
        ]
    return "\n".join(lines) + "\n"
