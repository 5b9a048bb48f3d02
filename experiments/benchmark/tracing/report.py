"""Markdown table of a fact-tracing result: per row, mean ± 95 % over seeds x facts, and the
target check (the best gradient rows against each lexical row, paired per seed and fact)."""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.benchmark.tracing.causal import CARRIERS, FILLED
from experiments.benchmark.tracing.metrics import mean_ci
from experiments.benchmark.utils.table import md_table

LEXICAL = ("TF-IDF (scikit-learn)", "BM25 (rank-bm25)")
NOT_GRADIENT = {"random", *LEXICAL, CARRIERS, FILLED}
WHY = {"refused": "refused", "error": "failed"}  # a row that did not run: the first reason


def pooled(result: dict, row: str, key: str) -> list[float]:
    """One metric of one row over every (seed, fact)."""
    return [v for s in result["seeds"] for v in s["rows"].get(row, {}).get(key, [])]


def _cell(values: list[float]) -> str:
    return "—" if not values else "{:.3f} ± {:.3f}".format(*mean_ci(values))


def write_report(result: dict[str, Any]) -> str:
    """The results table and the target check, as Markdown."""
    cfg, seeds = result["config"], result["seeds"]
    recall = [s["recall"] for s in seeds]
    lines = [
        f"seeds {cfg['seeds']}, {cfg['n_docs']} documents, {cfg['n_facts']} facts x "
        f"{cfg['copies']} copies, block {cfg['block']}, {cfg['epochs']} epochs; causal check: "
        f"one retraining per (row, fact) without that row's top-{cfg['k']} for the fact; wall "
        f"{result['wall_s']:.0f} s (OMP_NUM_THREADS={result['omp_num_threads']})",
        "",
        "model recall (per seed): multiple choice "
        + ", ".join(f"{r['multiple_choice']:.2f}" for r in recall)
        + "; top-1 over the vocabulary "
        + ", ".join(f"{r['top1_vocab']:.2f}" for r in recall),
    ]
    retrain = [s["retrain"] for s in seeds if "retrain" in s]
    if retrain:
        lines += ["", "retrainings per seed: " + ", ".join(
            f"{r['retrainings']} ({r['wall_s']:.0f} s wall, {r['each_s']:.1f} s each, "
            f"{r['jobs']} process{'es' * (r['jobs'] > 1)})" for r in retrain
        )]  # fmt: skip
    table, notes, failed = [], [], set()
    rows = list(dict.fromkeys(r for s in seeds for r in s["rows"]))
    for row in rows:
        per_seed = [s["rows"][row] for s in seeds if row in s["rows"]]
        why = [f"{w}: {p[k]}" for k, w in WHY.items() for p in per_seed if k in p]
        if why:
            table.append([row, why[0], "", "", "", "", ""])
            failed.add(row)
            continue
        said = [p["note"] for p in per_seed if "note" in p]
        notes += [f"* {row} (first seed): {said[0]}"] if said else []
        secs = [p["score_s"] for p in per_seed if "score_s" in p]
        peaks = [p["peak_mb"] for p in per_seed if p.get("peak_mb") is not None]
        removed = np.mean([r for p in per_seed for r in p["removed_per_fact"]])
        table.append(
            [row, *(_cell(pooled(result, row, k)) for k in ("recall@10", "mrr", "causal_drop")),
             f"{removed:.1f}", f"{np.mean(secs):.1f}" if secs else "—",
             f"{max(peaks):.0f}" if peaks else "—"]
        )  # fmt: skip
    heads = "method|recall@10|MRR|causal drop (nats)|docs removed / fact|score s|peak MB"
    lines += ["", md_table(heads, table).rstrip()]
    lines += ["", "notes:", *notes] if notes else []
    grads = [r for r in rows if r not in NOT_GRADIENT | failed]
    for lex in [r for r in LEXICAL if r in rows and r not in failed] if grads else []:
        lines += ["", target_check(result, grads, lex)]
    return "\n".join(lines) + "\n"


def target_check(result: dict, grads: list[str], lex: str) -> str:
    """The best gradient row on the causal drop beats ``lex``, and the best on recall@10 is
    within 0.05 of it (both paired per seed x fact)."""

    def best_minus_lex(key: str) -> tuple[str, float, float]:
        best = max(grads, key=lambda r: np.mean(pooled(result, r, key)))
        diff = np.asarray(pooled(result, best, key)) - np.asarray(pooled(result, lex, key))
        return best, *mean_ci(list(diff))

    (bc, dc, hc), (br, dr, hr) = best_minus_lex("causal_drop"), best_minus_lex("recall@10")
    return (
        f"target check vs **{lex}** (paired per seed x fact): best causal gradient row "
        f"**{bc}** minus {lex} = {dc:+.3f} ± {hc:.3f} nats "
        f"({'beats' if dc - hc > 0 else 'does not clearly beat'} it); "
        f"best recall@10 gradient row **{br}** minus {lex} = {dr:+.3f} ± {hr:.3f} "
        f"({'within' if dr >= -0.05 else 'not within'} 0.05)."
    )
