"""``dattri-llm index build|search``: a nearest-neighbour index over a projected gradient store."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from dattri_llm.cli._common import (
    HelpFormatter,
    UsageError,
    add_progress_flag,
    open_store,
    select_layers,
)

DESCRIPTION = """Build a FAISS index over a projected train gradient store (every layer stored as
one vector per sample), then answer top-k queries from it without a pass over the store.

  dattri-llm index build train_grads -o train_grads.index --metric cosine
  dattri-llm index search train_grads.index --test query_grads --k 10 --out scores
  dattri-llm top scores --texts train.jsonl

A flat (exact) index gives the scores of `dattri-llm attribute --method grad-dot|grad-cos
--top-k K` to float32 round-off; ivf and hnsw are approximate (docs/benchmarks/index.md). The
index refuses a store that changed since it was built: rebuild it with --overwrite."""

BUILD = """Build the index of a projected train store (FAISS files + index.json, no pickle).

Kinds: auto (flat while samples x dimension <= 2.5e8, else IVF-PQ with exact re-ranking,
its --nprobe chosen at build to reach --target-recall 0.95 on held-out vectors),
flat (exact), ivf (--nlist, --nprobe; --pq-m for product quantization with exact re-ranking
of --rerank x k candidates), hnsw (--M, --ef-construction, --ef-search)."""

SEARCH = """Search an index with the queries of a test store; writes an AttributionScore (top-k
proponents and opponents per query) to --out, readable by `dattri-llm top` and `report`."""


def add_parser(sub: Any) -> None:
    """Register the command and its two subcommands."""
    p = sub.add_parser(
        "index",
        help="build / search a nearest-neighbour index over a projected store",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", title="actions")
    b = actions.add_parser(
        "build", help="build an index", description=BUILD, formatter_class=HelpFormatter
    )
    b.add_argument("store", metavar="STORE", help="the train gradient store")
    b.add_argument("-o", "--out", required=True, metavar="INDEX_DIR", help="the index directory")
    b.add_argument("--metric", choices=("dot", "cosine"), default="dot", help="dot: Grad-Dot")
    b.add_argument("--kind", choices=("auto", "flat", "ivf", "hnsw"), default="auto")
    b.add_argument(
        "--layers",
        nargs="+",
        metavar="PATTERN",
        help="index only these layers: shell globs matched against whole layer names (as "
        "attribute --layers; a pattern that matches no layer is refused) (default: all)",
    )
    b.add_argument("--checkpoints", nargs="+", type=int, metavar="C", help="only these labels")
    b.add_argument("--nlist", type=int, help="ivf: inverted lists (default 4 sqrt(n))")
    b.add_argument("--nprobe", type=int, help="ivf: lists searched (default max(8, nlist / 32))")
    b.add_argument(
        "--target-recall",
        type=float,
        help="ivf: choose nprobe at build to reach this recall@10 on held-out vectors (auto: 0.95)",
    )
    b.add_argument("--pq-m", type=int, help="ivf: PQ sub-quantizers (must divide the dimension)")
    b.add_argument("--pq-bits", type=int, help="ivf with PQ: bits per code (8; 4: fast scan)")
    b.add_argument("--rerank", type=int, help="ivf with PQ: re-rank rerank x k exactly (4)")
    b.add_argument("--M", type=int, dest="M", help="hnsw: graph degree (32)")
    b.add_argument("--ef-construction", type=int, help="hnsw: build candidate list (80)")
    b.add_argument("--ef-search", type=int, help="hnsw: search candidate list (64)")
    b.add_argument("--overwrite", action="store_true", help="replace an index in INDEX_DIR")
    b.add_argument(
        "--block-rows", type=int, default=4096, help="rows read and added per block (4096)"
    )
    add_progress_flag(b)
    b.set_defaults(run=run_build)
    s = actions.add_parser(
        "search", help="search an index", description=SEARCH, formatter_class=HelpFormatter
    )
    s.add_argument("index", metavar="INDEX_DIR", help="a directory written by index build")
    s.add_argument("--test", required=True, metavar="STORE", help="the test (query) store")
    s.add_argument("--k", type=int, default=10, help="proponents and opponents per query")
    s.add_argument("--out", required=True, metavar="DIR", help="where the scores are written")
    s.add_argument("--store", metavar="STORE", help="the train store, if it moved")
    s.add_argument("--nprobe", type=int, help="ivf: lists searched (default: the build's)")
    s.add_argument("--ef-search", type=int, help="hnsw: candidate list (default: the build's)")
    s.add_argument("--rerank", type=int, help="ivf with PQ: re-rank rerank x k candidates")
    s.set_defaults(run=run_search)
    p.set_defaults(run=lambda ns: _no_action(p))


def _no_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _positive(args: argparse.Namespace, names: dict[str, str]) -> None:
    for attr, flag in names.items():
        value = getattr(args, attr)
        if value is not None and value < 1:
            raise UsageError(flag, f"must be >= 1, got {value}.")


def run_build(args: argparse.Namespace) -> int:
    """Run ``index build``."""
    from dattri_llm import GradientIndex
    from dattri_llm.cli._common import show_progress

    flags = {"nlist": "--nlist", "nprobe": "--nprobe", "pq_m": "--pq-m", "rerank": "--rerank"}
    flags |= {"pq_bits": "--pq-bits"}
    flags |= {"M": "--M", "ef_construction": "--ef-construction", "ef_search": "--ef-search"}
    _positive(args, {**flags, "block_rows": "--block-rows"})
    store = open_store(args.store, "STORE")
    names = {"ef_construction": "efConstruction", "ef_search": "efSearch"}
    params = {names.get(a, a): getattr(args, a) for a in flags if getattr(args, a) is not None}
    if args.target_recall is not None:
        if not 0 < args.target_recall <= 1:
            raise UsageError("--target-recall", f"must be in (0, 1], got {args.target_recall}.")
        params["target_recall"] = args.target_recall
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError("--out", f"{args.out!r} exists and is not a directory.")
    started = time.perf_counter()
    index = GradientIndex.build(
        store,
        args.out,
        metric=args.metric,
        kind=args.kind,
        layers=select_layers(args.layers, store.layer_names, f"STORE {store.save_dir}")
        if args.layers
        else None,
        checkpoints=args.checkpoints,
        overwrite=args.overwrite,
        show_progress=show_progress(args),
        block_rows=args.block_rows,
        **params,
    )
    size = sum(p["bytes"] for p in index.meta["parts"])
    print(
        f"indexed {len(index)} samples x {index.dim} numbers ({index.kind}, {index.metric}, "
        f"{len(index.meta['parts'])} part(s), {size / 2**20:.1f} MiB) in "
        f"{time.perf_counter() - started:.1f} s -> {args.out}"
    )
    if index.kind == "ivf" and index.expected_recall is not None:
        print(
            f"expected recall@10 {index.expected_recall:.3f} (measured on held-out train "
            f"vectors at nprobe {index.params['nprobe']}; test queries may reach less)"
        )
    return 0


def run_search(args: argparse.Namespace) -> int:
    """Run ``index search``."""
    from dattri_llm import GradientIndex

    _positive(args, {"k": "--k", "nprobe": "--nprobe", "ef_search": "--ef-search"})
    _positive(args, {"rerank": "--rerank"})
    if not os.path.isdir(args.index):
        raise UsageError("INDEX_DIR", f"{args.index!r} is not a directory (run index build).")
    test = open_store(args.test, "--test")
    store = open_store(args.store, "--store") if args.store else None
    started = time.perf_counter()
    index = GradientIndex.open(args.index, store=store)
    score = index.search(
        test, k=args.k, nprobe=args.nprobe, ef_search=args.ef_search, rerank=args.rerank
    )
    score.save(args.out)
    print(
        f"top {args.k} of {len(index)} samples for {score.num_test} queries ({index.kind}) in "
        f"{time.perf_counter() - started:.2f} s -> {args.out}"
    )
    return 0
