"""The house rules that a reader of the tree relies on, checked on the source itself.

* No import circle between the package's modules, counting imports deferred into functions and
  those under ``if TYPE_CHECKING:`` (a type-only circle still ties two modules together).
* Imports flow ``utils -> gradient -> attribution`` only.
* The capture core imports with torch alone (no transformers, dattri, trl or faiss).
* No module is aliased in ``sys.modules`` and no package reaches another's private names.
* ``import dattri_llm.attribution`` loads neither the HTML report, FAISS nor transformers.
"""

from __future__ import annotations

import ast
import re
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
        ("dattri_llm.utils", "dattri_llm.cli"),
        ("dattri_llm.gradient", "dattri_llm.cli"),
        ("dattri_llm.attribution", "dattri_llm.cli"),
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


def test_capture_core_imports_with_torch_alone() -> None:
    code = (
        "import sys\n"
        "import dattri_llm.gradient, dattri_llm.gradient.callbacks, dattri_llm.gradient.store\n"
        "import dattri_llm.gradient.ops, dattri_llm.gradient.trajectory\n"
        "heavy = [m for m in ('transformers', 'dattri', 'trl', 'faiss') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def test_no_module_aliasing() -> None:
    offenders = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in _modules().values()
        if "sys.modules[" in p.read_text(encoding="utf-8")
    )
    assert not offenders, f"modules aliased in sys.modules: {offenders}"


def test_attribution_imports_without_the_report_or_heavy_peers() -> None:
    code = (
        "import sys\n"
        "import dattri_llm, dattri_llm.attribution\n"
        "heavy = [m for m in ('transformers', 'faiss', 'dattri_llm.attribution.views.report')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


def _private_names_by_package() -> dict[str, set[str]]:
    """``{package directory: private names it defines}`` (defs, classes, assignments)."""
    out: dict[str, set[str]] = {}
    for path in _modules().values():
        names = out.setdefault(str(path.parent), set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {
        k: {n for n in v if n.startswith("_") and not n.startswith("__")} for k, v in out.items()
    }


def test_no_package_reaches_another_packages_private_names() -> None:
    """``obj._name`` outside ``self`` / ``cls`` names something of the module's own package.

    (Private names of torch or transformers are theirs to judge; ``_replace`` is the named
    tuple's public method.)
    """
    defined = _private_names_by_package()
    ours = set().union(*defined.values()) - {"_replace"}
    wrong = []
    for module, path in _modules().items():
        own = defined[str(path.parent)]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or node.attr not in ours or node.attr in own:
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
                continue
            wrong.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, f"private names reached across packages: {wrong}"


def test_architecture_map_names_only_paths_that_exist() -> None:
    """Every file or folder ``docs/ARCHITECTURE.md`` names in backticks exists."""
    root = PACKAGE.parent
    text = (root / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([\w./]+(?:\.py|/))`", text))
    assert len(named) > 40  # the map names its modules; a broken pattern would find none
    files = {f.name for f in PACKAGE.rglob("*.py")}

    def exists(p: str) -> bool:  # a bare file name is a module of the room the row describes
        return any((base / p).exists() for base in (root, PACKAGE)) or ("/" not in p and p in files)

    missing = sorted(p for p in named if not exists(p))
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"
