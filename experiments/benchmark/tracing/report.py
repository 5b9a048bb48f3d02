"""Markdown table of a fact-tracing result (:mod:`.run`): means with 95 % intervals.

Every per-fact value is pooled over seeds x facts; the interval is the normal approximation
``1.96 sd / sqrt(n)``. The best gradient rows are compared with each lexical row (TF-IDF,
BM25) *paired* per (seed, fact): the benchmark's target.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.benchmark.tracing.metrics import mean_ci

#: The lexical baselines, each checked against the best gradient rows.
LEXICAL = ("TF-IDF (scikit-learn)", "BM25 (rank-bm25)")
CONTROLS = ("carriers (ground truth)", "carriers + random (same size)")
NOT_GRADIENT = {"random", *LEXICAL, *CONTROLS}


def pooled(result: dict, row: str, key: str) -> list[float]:
    """One metric of one row over every (seed, fact)."""
    return [v for s in result["seeds"] for v in s["rows"][row].get(key, [])]


def _cell(values: list[float]) -> str:
    if not values:
        return "—"
    m, h = mean_ci(values)
    return f"{m:.3f} ± {h:.3f}"


def write_report(result: dict[str, Any]) -> str:
    """The results table and the target check, as Markdown."""
    cfg = result["config"]
    rows = list(dict.fromkeys(r for s in result["seeds"] for r in s["rows"]))
    recall = [s["recall"] for s in result["seeds"]]
    retrain = [s["retrain"] for s in result["seeds"] if "retrain" in s]
    lines = [
        f"seeds {cfg['seeds']}, {cfg['n_docs']} documents, {cfg['n_facts']} facts x "
        f"{cfg['copies']} copies, block {cfg['block']}, {cfg['epochs']} epochs; "
        f"causal check: one retraining per (row, fact) without that row's top-{cfg['k']} "
        f"for the fact; wall {result['wall_s']:.0f} s "
        f"(OMP_NUM_THREADS={result['omp_num_threads']}, shared 2-core machine)",
        "",
        "model recall (per seed): multiple choice "
        + ", ".join(f"{r['multiple_choice']:.2f}" for r in recall)
        + "; top-1 over the vocabulary "
        + ", ".join(f"{r['top1_vocab']:.2f}" for r in recall),
    ]
    if retrain:
        lines += [
            "",
            "retrainings per seed: "
            + ", ".join(
                f"{r['retrainings']} ({r['wall_s']:.0f} s wall, {r['each_s']:.1f} s each, "
                f"{r['jobs']} process{'es' if r['jobs'] > 1 else ''})"
                for r in retrain
            ),
        ]
    lines += [
        "",
        "| method | recall@10 | MRR | causal drop (nats) | docs removed / fact | score s "
        "| peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for row in rows:
        per_seed = [s["rows"][row] for s in result["seeds"] if row in s["rows"]]
        refused = [p["refused"] for p in per_seed if "refused" in p]
        errors = [p["error"] for p in per_seed if "error" in p]
        if refused or errors:
            why = f"refused: {refused[0]}" if refused else f"failed: {errors[0]}"
            lines.append(f"| {row} | {why} | | | | | |")
            continue
        said = [p["note"] for p in per_seed if "note" in p]
        notes += [f"* {row} (first seed; every seed's in the JSON): {said[0]}"] if said else []
        removed = np.mean([r for p in per_seed for r in p["removed_per_fact"]])
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
    if notes:
        lines += ["", "notes:", *notes]
    failed = {
        r for s in result["seeds"] for r, v in s["rows"].items() if "error" in v or "refused" in v
    }
    grads = [r for r in rows if r not in NOT_GRADIENT and r not in failed]
    lexical = [r for r in LEXICAL if r in rows and r not in failed]
    if grads and lexical:
        lines += [line for lex in lexical for line in ("", target_check(result, grads, lex))]
    return "\n".join(lines) + "\n"


def paired(result: dict, row: str, other: str, key: str) -> tuple[float, float]:
    """Mean and 95 % half-width of ``row − other`` paired per (seed, fact)."""
    a = np.asarray(pooled(result, row, key))
    b = np.asarray(pooled(result, other, key))
    return mean_ci(list(a - b))


def target_check(result: dict, grads: list[str], lex: str) -> str:
    """The issue's target against one lexical row: the best gradient row on the causal drop
    beats it, and the best on recall@10 is within 0.05 of it (paired per seed x fact)."""
    best_c = max(grads, key=lambda r: np.mean(pooled(result, r, "causal_drop")))
    best_r = max(grads, key=lambda r: np.mean(pooled(result, r, "recall@10")))
    dc = paired(result, best_c, lex, "causal_drop")
    dr = paired(result, best_r, lex, "recall@10")
    return (
        f"target check vs **{lex}** (paired per seed x fact): best causal gradient row "
        f"**{best_c}** minus {lex} = {dc[0]:+.3f} ± {dc[1]:.3f} nats "
        f"({'beats' if dc[0] - dc[1] > 0 else 'does not clearly beat'} it); "
        f"best recall@10 gradient row **{best_r}** minus {lex} = {dr[0]:+.3f} ± {dr[1]:.3f} "
        f"({'within' if dr[0] >= -0.05 else 'not within'} 0.05)."
    )
