"""``dattri-llm top SCORES``: the most influential training samples of each query, as a table."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dattri_llm.cli._common import (
    HelpFormatter,
    UsageError,
    load_scores,
    load_texts_arg,
    snippet,
    terminal_width,
)

DESCRIPTION = """Print the top proponents (largest scores: the training samples that helped the
query most) and opponents (smallest scores) of each query of an AttributionScore directory.

Texts come from JSON Lines files, one object per sample: {"id": SAMPLE_HASH, "text": ...} (the
hash as dattri_llm.hash_sample gives it), or {"input_ids": [...], "text": ...} (matched by content
hash). Other scalar fields (e.g. "topic") are shown as labels. Stores written by dattri-llm
capture keep their texts: without --texts / --test-texts they are used.

Each shown sample says how often it occurred under one checkpoint label when more than once
("x4": its rows were combined by the scores' repeats rule; --json lists the steps), and LEAK
marks a training sample identical to the query (same hash, or same text when both texts are
given). The scoring run's warnings are printed first (on standard error with --json), and a
texts file that matches none of the ids is warned about."""


def add_parser(sub: Any) -> None:
    """Register the command."""
    p = sub.add_parser(
        "top",
        help="the top proponents and opponents of each query",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("scores", metavar="SCORES", help="a directory written by dattri-llm attribute")
    p.add_argument(
        "--query",
        nargs="+",
        metavar="I",
        default=None,
        help="only these queries: column indices, or sample hashes (a prefix is enough) "
        "(default: all)",
    )
    p.add_argument("--k", type=int, default=10, help="proponents and opponents per query")
    p.add_argument("--texts", metavar="FILE", help="JSON Lines texts of the training samples")
    p.add_argument("--test-texts", metavar="FILE", help="JSON Lines texts of the queries")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def select_queries(score: Any, wanted: Sequence[str] | None, argument: str) -> list[int] | None:
    """Column indices from indices or hash prefixes; ``None`` for all."""
    if wanted is None:
        return None
    out = []
    for w in wanted:
        if w.lstrip("-").isdigit():
            i = int(w)
            if not 0 <= i < score.num_test:
                raise UsageError(argument, f"query {i} out of range: {score.num_test} queries.")
            out.append(i)
            continue
        hits = [j for j, h in enumerate(score.test_hashes) if h.startswith(w)]
        if len(hits) != 1:
            what = "no query" if not hits else f"{len(hits)} queries"
            raise UsageError(argument, f"{what} with a hash starting with {w!r}.")
        out.append(hits[0])
    return out


def _entries(
    hashes: list[str],
    values: Any,
    texts: Mapping[str, Any],
    notes: Mapping[str, Any],
    query: tuple[str, Any],
) -> list[dict]:
    from dattri_llm.attribution.views.notes import leak

    out = []
    for h, v in zip(hashes, values.tolist()):
        sample = texts.get(h)
        occ = notes.get(h)
        out.append(
            {
                "hash": h,
                # JSON has no NaN or infinity: a non-finite score is null, never a bare NaN
                "score": v if math.isfinite(v) else None,
                "text": None if sample is None else sample.text,
                "labels": {} if sample is None else sample.labels,
                "occurrences": None if occ is None else occ.as_json(),
                "leak": leak(h, query[0], sample, query[1]),
            }
        )
    return out


def collect(
    score: Any,
    k: int,
    texts: Mapping[str, Any],
    queries: list[int] | None,
    test_texts: Mapping[str, Any] | None = None,
) -> list[dict]:
    """The top-k of each selected query, as JSON-ready dicts.

    Each entry holds its ``occurrences`` (``{"count": n, "steps": {checkpoint: [steps]}}``)
    and ``leak`` (identical to the query).
    """
    from dattri_llm.attribution.views.notes import occurrence_notes

    top = score.top_k(k)
    test_texts = test_texts or {}
    cols = list(range(score.num_test)) if queries is None else queries
    notes = occurrence_notes(
        score, {h for j in cols for h in top.proponent_hashes[j] + top.opponent_hashes[j]}
    )
    out = []
    for j in cols:
        h = score.test_hashes[j]
        q = test_texts.get(h)
        out.append(
            {
                "query": j,
                "hash": h,
                "text": None if q is None else q.text,
                "repeats": score.repeats,
                "proponents": _entries(
                    top.proponent_hashes[j], top.proponent_scores[j], texts, notes, (h, q)
                ),
                "opponents": _entries(
                    top.opponent_hashes[j], top.opponent_scores[j], texts, notes, (h, q)
                ),
            }
        )
    return out


def print_top(
    score: Any,
    k: int,
    texts: Mapping[str, Any],
    queries: list[int] | None,
    test_texts: Mapping[str, Any] | None = None,
) -> None:
    """Print the tables (the texts one line each, cut to the terminal's width)."""
    width = terminal_width()
    for item in collect(score, k, texts, queries, test_texts):
        head = f"query {item['query']}  {item['hash'][:12]}"
        if item["text"] is not None:
            head += "  " + snippet(item["text"], max(width - len(head) - 2, 20))
        print(head)
        for kind in ("proponents", "opponents"):
            print(f"  {kind}:")
            for r, e in enumerate(item[kind], 1):
                left = f"  {r:>3}  {e['score']:+.4e}  {e['hash'][:12]}"
                occ = e["occurrences"]
                if occ is not None and occ["count"] > 1:
                    left += f"  x{occ['count']}"
                if e["leak"]:
                    left += "  LEAK"
                labels = " ".join(f"[{k}={v}]" for k, v in e["labels"].items())
                text = "" if e["text"] is None else f"{labels} {e['text']}".strip()
                room = max(width - len(left) - 2, 20)
                print(f"{left}  {snippet(text, room)}" if text else left)
        print()


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    if args.k < 1:
        raise UsageError("--k", f"must be >= 1, got {args.k}.")
    score = load_scores(args.scores, "SCORES")
    texts = load_texts_arg(args.texts, "--texts", args.scores, "train store")
    test_texts = load_texts_arg(args.test_texts, "--test-texts", args.scores, "test store")
    queries = select_queries(score, args.query, "--query")
    notices = _notices(score, texts, test_texts, args)
    for line in notices:
        print(f"dattri-llm top: warning: {line}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                collect(score, args.k, texts, queries, test_texts), indent=1, allow_nan=False
            )
        )
    else:
        print_run_warnings(score)
        print_top(score, args.k, texts, queries, test_texts)
    return 0


def _notices(score: Any, texts: Mapping, test_texts: Mapping, args: Any) -> list[str]:
    """Warnings about the command's inputs: texts files that match no id."""
    from dattri_llm.attribution.views.notes import unmatched_texts

    out = [
        unmatched_texts(texts, score.train_hashes, "training samples", f"--texts {args.texts}"),
        unmatched_texts(
            test_texts, score.test_hashes, "queries", f"--test-texts {args.test_texts}"
        ),
    ]
    if args.json:  # the table prints them first; JSON keeps standard output parseable
        out += [f"the scoring run warned: {w}" for w in score.warnings]
    return [line for line in out if line]


def print_run_warnings(score: Any) -> None:
    """The scoring run's warnings (kept in the scores), before the tables."""
    if not score.warnings:
        return
    print(f"warnings of the scoring run ({len(score.warnings)}):")
    for w in score.warnings:
        print(f"  - {' '.join(w.split())}")
    print()
