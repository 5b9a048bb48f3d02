"""The house rules that a reader of the tree relies on, checked on the source itself.

* No import circle between the package's modules, counting imports deferred into functions and
  those under ``if TYPE_CHECKING:`` (a type-only circle still ties two modules together).
* Imports flow ``utils -> gradient -> attribution`` only.
* The capture core imports with torch alone (no transformers, dattri, trl or faiss).
* Modules that moved into subpackages keep their old import paths, as the same module objects.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dattri_llm"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _package_exports(path: Path, module: str) -> dict[str, str]:
    """For a package ``__init__``: each name it imports -> the module it comes from."""
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, True)
            out.update({alias.asname or alias.name: source for alias in node.names})
    return out


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, every import counted.

    ``from package import name`` follows the package's own re-export of ``name`` to the module
    that defines it (importing a name is not importing every sibling of its package).
    """
    modules = _modules()
    exports = {m: _package_exports(p, m) for m, p in modules.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(node, module, is_package)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        targets.add(sub)
                    elif source in exports and source != module:
                        targets.add(exports[source].get(alias.name, source))
                    else:
                        targets.add(source)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circle_finder_finds_a_type_only_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles (TYPE_CHECKING imports counted): " + "; ".join(
        " <-> ".join(c) for c in found
    )


@pytest.mark.parametrize(
    ("lower", "upper"),
    [
        ("dattri_llm.utils", "dattri_llm.gradient"),
        ("dattri_llm.utils", "dattri_llm.attribution"),
        ("dattri_llm.gradient", "dattri_llm.attribution"),
    ],
)
def test_imports_flow_one_way(lower: str, upper: str) -> None:
    wrong = sorted(
        f"{m} -> {t}"
        for m, targets in import_graph().items()
        if m == lower or m.startswith(lower + ".")
        for t in targets
        if t == upper or t.startswith(upper + ".")
    )
    assert not wrong, f"{lower} must not import {upper}: {wrong}"


def test_modules_stay_under_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules().values()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert not long, f"split these modules by concept: {long}"


def test_capture_core_imports_with_torch_alone() -> None:
    code = (
        "import sys\n"
        "import dattri_llm.gradient, dattri_llm.gradient.callbacks, dattri_llm.gradient.store\n"
        "import dattri_llm.gradient.ops, dattri_llm.gradient.trajectory\n"
        "heavy = [m for m in ('transformers', 'dattri', 'trl', 'faiss') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


_OLD_NAMES = {"blocks", "distributed", "prepared", "resume", "scoring", "sinks", "units"}
_OLD_NAMES |= {"curvature", "training", "unroll", "report", "token_view"}


def test_every_moved_module_is_aliased() -> None:
    from dattri_llm.attribution import _MOVED_MODULES

    assert set(_MOVED_MODULES) == _OLD_NAMES


@pytest.mark.parametrize("old", sorted(_OLD_NAMES))
def test_moved_modules_keep_their_old_paths(old: str) -> None:
    from dattri_llm.attribution import _MOVED_MODULES

    new = _MOVED_MODULES[old]
    moved = importlib.import_module(f"dattri_llm.attribution.{new}")
    assert importlib.import_module(f"dattri_llm.attribution.{old}") is moved
    package = importlib.import_module("dattri_llm.attribution")
    assert getattr(package, old) is moved


def test_old_trajectory_module_names_still_import() -> None:
    from dattri_llm.attribution.trajectory import (
        StepIndex,
        TrajectoryAttributor,
        as_schedule,
        base,
        dense_rows,
        step_index,
    )

    assert (StepIndex, TrajectoryAttributor, as_schedule, dense_rows, step_index) == (
        base.StepIndex,
        base.TrajectoryAttributor,
        base.as_schedule,
        base.dense_rows,
        base.step_index,
    )
