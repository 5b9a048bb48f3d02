"""The ``dattri-llm`` command line (also ``python -m dattri_llm``).

One module per command, each with ``add_parser(subparsers)``; every command works through the
library's public API only. Commands: ``inspect`` (what a gradient store holds), ``attribute``
(scores from two stores; the methods are the registry in :mod:`dattri_llm.cli.attribute`),
``top`` (the most influential training samples of each query), ``report`` (a self-contained
HTML page), ``index`` (build / search a nearest-neighbour index over a projected store),
``capture`` (a saved model and a corpus file to a store), ``serve`` (an attribution explorer
over HTTP) and ``demo``. Exit codes are in :mod:`dattri_llm.cli._common`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from dattri_llm.cli import attribute, capture, demo, index, inspect_store, report, serve, top
from dattri_llm.cli._common import (
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CommandError,
    HelpFormatter,
)

__all__ = ["main", "build_parser", "version"]

_COMMANDS = (capture, inspect_store, attribute, top, report, index, serve, demo)

WORKFLOW = """workflow:
  0. no code: dattri-llm capture MODEL train.jsonl --out train_grads (and the queries), then
     dattri-llm serve --model MODEL --train train_grads, or the steps below
  1. capture: wrap your training loop in a HookManager with an OffloadCallback (Python; see
     README "1. Attribution from disk offloading"), for the training set and the queries
  2. dattri-llm inspect train_grads --verify
  3. dattri-llm attribute --method grad-cos --train train_grads --test query_grads --out scores
  4. dattri-llm top scores --texts train.jsonl
  5. dattri-llm report scores --train-texts train.jsonl --test-texts queries.jsonl -o report.html

"dattri-llm COMMAND --help" describes each command."""


def version() -> str:
    """``dattri-llm X (torch Y, Python Z)``, without importing torch."""
    from importlib import metadata

    from dattri_llm import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        torch_version = "not installed"
    py = ".".join(map(str, sys.version_info[:3]))
    return f"dattri-llm {__version__} (torch {torch_version}, Python {py})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dattri-llm`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="dattri-llm",
        description="Training data attribution for LLM-scale models, from the command line.",
        epilog=f"{WORKFLOW}\n\n{EXIT_CODES}",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in _COMMANDS:
        module.add_parser(sub)
    return parser


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])  # str(KeyError) would quote the message
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dattri-llm`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors: argparse's codes (0 or 2)
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"dattri-llm {args.command}"

    def show_warning(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        # one line per warning: the message, not the library's source line that raised it
        print(f"{prog}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            code = args.run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except CommandError as e:
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.code
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError, OSError) as e:
        if args.debug:
            raise
        print(f"{prog}: error: {_message(e)}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK if code is None else int(code)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
