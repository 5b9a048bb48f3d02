"""Command line: ``dattri-llm demo`` (also ``python -m dattri_llm demo``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = """usage: dattri-llm <command> [options]

commands:
  demo     train a small GPT-2 on Python's documentation topics while offloading per-sample
           gradients, then attribute held-out paragraphs (offline, ~1 minute on 2 cores)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dattri-llm`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from dattri_llm.demo import main as demo_main

        demo_main(rest)
        return 0
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
