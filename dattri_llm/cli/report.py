"""``dattri-llm report SCORES -o report.html``: a self-contained HTML page of the attribution."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from dattri_llm.cli._common import HelpFormatter, UsageError, load_scores, load_texts_arg
from dattri_llm.cli.top import select_queries

DESCRIPTION = """Write one self-contained HTML file (no scripts, no network): a summary (method,
stores, settings, a histogram of the scores), then for each query its text and its top-k
proponents and opponents with their scores and texts, how often each repeated under one
checkpoint label, a flag on a training sample identical to the query, and the scoring run's
warnings; long texts are folded. With token-level scores (attribute --granularity token) and a
"tokens" list in the training texts' rows, each shown sample also gets a per-token heatmap.
Every text is escaped. Texts files that match none of the ids are warned about.

Texts: JSON Lines, one object per sample, {"id": SAMPLE_HASH, "text": ...} or
{"input_ids": [...], "text": ...} (see dattri-llm top --help); stores written by dattri-llm
capture keep their texts, used when these flags are not given."""


def add_parser(sub: Any) -> None:
    """Register the command."""
    p = sub.add_parser(
        "report",
        help="write a self-contained HTML report of the scores",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("scores", metavar="SCORES", help="a directory written by dattri-llm attribute")
    p.add_argument("--train-texts", metavar="FILE", help="JSON Lines texts of the training samples")
    p.add_argument("--test-texts", metavar="FILE", help="JSON Lines texts of the queries")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    p.add_argument("--k", type=int, default=10, help="proponents and opponents per query")
    p.add_argument(
        "--query", nargs="+", metavar="I", default=None, help="only these queries (default: all)"
    )
    p.add_argument("--title", default="Training data attribution", help="page title")
    p.add_argument("--fold", type=int, default=200, help="fold texts longer than this many chars")
    p.add_argument(
        "--token-k", type=int, default=3, help="token heatmaps for this many samples per list"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    from dattri_llm.attribution.views.report import write_report

    for flag, value, low in (
        ("--k", args.k, 1),
        ("--fold", args.fold, 1),
        ("--token-k", args.token_k, 0),
    ):
        if value < low:
            raise UsageError(flag, f"must be >= {low}, got {value}.")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        raise UsageError("--output", f"{args.output!r} is a directory; give a file name.")
    score = load_scores(args.scores, "SCORES")
    train = load_texts_arg(args.train_texts, "--train-texts", args.scores, "train store")
    test = load_texts_arg(args.test_texts, "--test-texts", args.scores, "test store")
    queries = select_queries(score, args.query, "--query")
    from dattri_llm.attribution.views.notes import unmatched_texts

    for texts, hashes, what, flag in (
        (train, score.train_hashes, "training samples", f"--train-texts {args.train_texts}"),
        (test, score.test_hashes, "queries", f"--test-texts {args.test_texts}"),
    ):
        line = unmatched_texts(texts, hashes, what, flag)
        if line:
            print(f"dattri-llm report: warning: {line}", file=sys.stderr)
    settings: dict = {"scores": os.path.abspath(args.scores)}
    run_file = os.path.join(args.scores, "attribution_run.json")
    if os.path.isfile(run_file):
        with open(run_file, encoding="utf-8") as f:
            try:
                settings.update(json.load(f))
            except json.JSONDecodeError:
                settings["settings"] = f"{run_file} is not valid JSON"
    os.makedirs(out_dir, exist_ok=True)
    path = write_report(
        args.output,
        score,
        train,
        test,
        k=args.k,
        title=args.title,
        settings=settings,
        queries=queries,
        fold_chars=args.fold,
        token_k=args.token_k,
    )
    missing = sum(h not in train for h in dict.fromkeys(score.train_hashes))
    note = f" ({missing} training samples without a text)" if train and missing else ""
    shown = score.num_test if queries is None else len(queries)
    print(f"wrote {path}: {shown} queries, top {args.k}{note}")
    return 0
