"""``dattri-llm top SCORES``: the most influential training samples of each query, as a table."""

from __future__ import annotations

import argparse
import json
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
capture keep their texts: without --texts / --test-texts they are used."""


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


def _entries(hashes: list[str], values: Any, texts: Mapping[str, Any]) -> list[dict]:
    out = []
    for h, v in zip(hashes, values.tolist()):
        sample = texts.get(h)
        out.append(
            {
                "hash": h,
                "score": v,
                "text": None if sample is None else sample.text,
                "labels": {} if sample is None else sample.labels,
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
    """The top-k of each selected query, as JSON-ready dicts."""
    top = score.top_k(k)
    test_texts = test_texts or {}
    out = []
    for j in range(score.num_test) if queries is None else queries:
        h = score.test_hashes[j]
        q = test_texts.get(h)
        out.append(
            {
                "query": j,
                "hash": h,
                "text": None if q is None else q.text,
                "proponents": _entries(top.proponent_hashes[j], top.proponent_scores[j], texts),
                "opponents": _entries(top.opponent_hashes[j], top.opponent_scores[j], texts),
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
    if args.json:
        print(json.dumps(collect(score, args.k, texts, queries, test_texts), indent=1))
    else:
        print_top(score, args.k, texts, queries, test_texts)
    return 0
