"""``dattri-llm demo``: a real attribution on a tiny GPT-2 and Python's own docs, offline."""

from __future__ import annotations

import argparse
from typing import Any

from dattri_llm.cli._common import HelpFormatter, plain


def add_parser(sub: Any) -> None:
    """Register the command."""
    from dattri_llm import demo  # light: torch and transformers are imported when it runs

    p = sub.add_parser(
        "demo",
        help="train a tiny GPT-2 while offloading gradients, then attribute (offline, ~1 min)",
        description=plain(demo.__doc__),
        formatter_class=HelpFormatter,
    )
    demo.add_arguments(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from dattri_llm.demo import run

    if not args.serve:
        run(args)
        return 0
    import tempfile

    from dattri_llm.cli import serve

    with tempfile.TemporaryDirectory(prefix="dattri_llm_demo_") as tmp:
        if args.workdir is None:
            args.workdir = tmp
        summary = run(args)
        ns = serve.build_parser_defaults(
            model=summary["model_dir"], train=summary["explorer_store"]
        )
        ns.port = args.port
        return serve.run(ns)
