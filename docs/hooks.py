"""MkDocs hooks for the documentation site (``hooks:`` in ``mkdocs.yml``).

Two things the site must not get wrong are generated or checked here rather than written by
hand: the command-line reference is the parser's own ``--help`` text, and every name the
package exports (``_EXPORTS`` in ``dattri_llm/__init__.py``) has an entry in the API reference.
A missing name is logged as a warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.dattri_llm")

ROOT = Path(__file__).resolve().parent.parent
CLI_MARKER = "<!-- cli-help -->"
REFERENCE_DIR = "reference/"
_ENTRY = re.compile(r"^::: +([\w.]+)\s*$", re.M)
# the docstrings' Sphinx roles (``:class:`~a.b.C` ``), which Markdown renders as text + code
_ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def exported_names() -> dict[str, str]:
    """``_EXPORTS`` read from the package's ``__init__.py`` without importing it (no torch)."""
    tree = ast.parse((ROOT / "dattri_llm" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_EXPORTS" and node.value is not None:
            return ast.literal_eval(node.value)
    raise RuntimeError("dattri_llm/__init__.py defines no _EXPORTS")


def cli_help() -> str:
    """``dattri-llm --help`` and each command's ``--help`` (and sub-command's), as Markdown."""
    import argparse

    from dattri_llm.cli import build_parser

    sections: list[str] = []

    def add(parser: argparse.ArgumentParser, title: str, level: int) -> None:
        text = parser.format_help().rstrip()
        sections.append(f"{'#' * level} `{title}`\n\n```text\n{text}\n```\n")
        for action in parser._actions:  # argparse keeps sub-parsers only here
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    add(sub, f"{title} {name}", min(level + 1, 4))

    os.environ.setdefault("COLUMNS", "100")  # argparse wraps help to the terminal's width
    parser = build_parser()
    parser.prog = "dattri-llm"
    add(parser, "dattri-llm", 2)
    return "\n".join(sections)


def on_config(config: Any) -> Any:
    """Start each build with an empty record of the reference's entries."""
    config.extra["_documented"] = set()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand the CLI marker; record which objects the reference pages document."""
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_help())
    if page.file.src_uri.startswith(REFERENCE_DIR):
        config.extra["_documented"].update(_ENTRY.findall(markdown))
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Show a docstring's ``:class:`~a.b.C` `` as ``C`` (``:class:`a.b.C` `` as ``a.b.C``)."""
    return _ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)


def on_post_build(config: Any) -> None:
    """Warn about every exported name that no reference page documents."""
    documented = {path.rsplit(".", 1)[-1] for path in config.extra["_documented"]}
    for name, module in sorted(exported_names().items()):
        if name not in documented:
            log.warning(
                "dattri_llm.%s (from %s) is exported but has no '::: %s.%s' entry under docs/%s",
                name,
                module,
                module,
                name,
                REFERENCE_DIR,
            )
