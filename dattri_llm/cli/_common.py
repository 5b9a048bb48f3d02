"""What every command shares: exit codes, errors that name the argument, inputs, output."""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
from typing import Any

from dattri_llm.utils.names import close_candidates

__all__ = [
    "plain",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "EXIT_DAMAGED",
    "EXIT_INTERRUPTED",
    "CommandError",
    "UsageError",
    "HelpFormatter",
    "add_progress_flag",
    "open_store",
    "load_scores",
    "load_texts_arg",
    "select_layers",
    "RUN_FILE",
    "snippet",
]

#: Written beside the scores by ``attribute``: the method and settings of the run.
RUN_FILE = "attribution_run.json"

#: Success.
EXIT_OK = 0
#: The command ran and failed (e.g. the stores are incompatible, a file is unreadable).
EXIT_ERROR = 1
#: The command line is wrong (an unknown option, a missing or invalid argument).
EXIT_USAGE = 2
#: ``inspect --verify`` found damaged files (each is named on standard error).
EXIT_DAMAGED = 3
#: Interrupted (Ctrl-C).
EXIT_INTERRUPTED = 130

EXIT_CODES = f"""exit codes:
  {EXIT_OK}    success
  {EXIT_ERROR}    the command failed (the message says why)
  {EXIT_USAGE}    invalid command line (the message names the argument)
  {EXIT_DAMAGED}    inspect --verify found damaged files
  {EXIT_INTERRUPTED}  interrupted"""


class CommandError(Exception):
    """A failure reported as ``dattri-llm COMMAND: error: MESSAGE`` with exit ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


class UsageError(CommandError):
    """An invalid argument value (exit 2); the message starts with the argument's name."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument {argument}: {message}", EXIT_USAGE)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps description layouts and shows every option's default (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" not in text
            and not any(default is x for x in (None, False, argparse.SUPPRESS))
            and (action.option_strings or action.nargs in ("?", "*"))
        ):
            text += " (default: %(default)s)"
        return text


def add_progress_flag(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: bars on standard error, by default on a terminal."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bars on standard error (default: only when it is a terminal)",
    )


def show_progress(args: argparse.Namespace) -> bool | None:
    """Progress bars for ``args``: forced on / off, or ``None`` (only on a terminal)."""
    return None if args.progress is None else bool(args.progress)


def open_store(path: str, argument: str) -> Any:
    """Open the gradient store at ``path``; an error names ``argument`` and says what is wrong."""
    from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError

    if not os.path.exists(path):
        raise UsageError(argument, f"{path!r} does not exist (expected a gradient store).")
    if not os.path.isdir(path):
        raise UsageError(argument, f"{path!r} is not a directory (expected a gradient store).")
    try:
        store = GradientStorageManager(path)
    except StoreFormatError as e:
        from dattri_llm.gradient.store.format import META_FILE

        if os.path.isfile(os.path.join(path, META_FILE)):
            raise UsageError(argument, str(e)) from None
        held = sorted(os.listdir(path))
        raise UsageError(  # a reader's wording: the store is read, never written, here
            argument,
            f"{path!r} is not a gradient store: it has no {META_FILE} (it holds {held[:5]}"
            f"{' ...' if len(held) > 5 else ''}). Pass the save_dir an OffloadCallback / "
            "GradientStorageManager wrote during capture.",
        ) from None
    if len(store) == 0:
        raise UsageError(
            argument,
            f"{path!r} holds no gradient records: pass the save_dir a GradientStorageManager "
            "wrote during capture.",
        )
    return store


def plain(doc: str | None) -> str:
    """A docstring for ``--help``: Sphinx roles and double backquotes removed.

    ``:class:`~dattri_llm.OffloadCallback``` becomes ``OffloadCallback`` and ````x```` becomes
    ``x``.
    """
    if not doc:
        return ""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], doc)
    return text.replace("``", "")


def load_scores(path: str, argument: str) -> Any:
    """Load an :class:`AttributionScore` directory; an error names ``argument``."""
    from dattri_llm.attribution.score import AttributionScore

    if not os.path.isdir(path):
        raise UsageError(
            argument, f"{path!r} is not a directory (expected the --out of dattri-llm attribute)."
        )
    try:
        return AttributionScore.load(path)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(argument, str(e)) from None


def load_texts_arg(
    path: str | None, argument: str, scores: str | None = None, side: str = "train store"
) -> dict:
    """Read a texts JSONL (``dattri_llm.attribution.views.report.load_texts``).

    Without ``path``, the texts that ``dattri-llm capture`` kept in the store of the run's
    ``side`` (``"train store"`` or ``"test store"``, read from the ``scores`` directory's run
    file) are used when there are; else ``{}``.
    """
    from dattri_llm.attribution.views.report import load_texts

    if path is None:
        store = _run_settings(scores).get(side) if scores is not None else None
        if not isinstance(store, str):
            return {}
        from dattri_llm.gradient.causal_lm import TEXTS_FILE

        path = os.path.join(store, TEXTS_FILE)
        if not os.path.isfile(path):
            return {}

    if not os.path.isfile(path):
        raise UsageError(argument, f"{path!r} is not a file (expected JSON Lines of texts).")
    try:
        return load_texts(path)
    except ValueError as e:
        raise UsageError(argument, str(e)) from None


def select_layers(patterns: list[str], names: list[str], store: str) -> list[str]:
    """The layers ``--layers`` names, in store order: shell globs over whole layer names.

    The one reading of ``--layers`` in every command (``attribute``, ``index build``).

    One pattern language: each pattern is a glob matched against the whole layer name by
    ``fnmatch.fnmatchcase`` (``*`` any run of characters, dots included; ``?`` one character;
    ``[...]`` a set), so a plain name selects that layer alone and ``transformer.h.1.*``
    selects block 1 and not blocks 10 and 11. (``HookManagerConfig`` selects modules with
    full-match regexes instead; this option is about stored layers and reads globs only.)

    Raises:
        UsageError: a pattern that matches no layer of ``store``, listing the candidates.
    """
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            raise UsageError(
                "--layers",
                f"[{pattern!r}] matches no layer of {store} (patterns are shell globs matched "
                f"against whole layer names: '*' also crosses dots). Closest: "
                f"{close_candidates(pattern, names)}; it holds {names}.",
            )
        chosen |= hits
    return [n for n in names if n in chosen]


def _run_settings(scores: str) -> dict:
    """The run file of a scores directory (``{}`` when missing or unreadable)."""
    import json

    try:
        with open(os.path.join(scores, RUN_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def snippet(text: str, width: int) -> str:
    """One line of at most ``width`` characters.

    Whitespace is collapsed and control characters are shown escaped, so that a text cannot
    write terminal codes.
    """
    from dattri_llm.attribution.views.token_view import display_token

    line = display_token(" ".join(text.split()))
    return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def terminal_width(default: int = 100) -> int:
    """Columns of the terminal (``default`` when the output is not one)."""
    return shutil.get_terminal_size((default, 24)).columns
