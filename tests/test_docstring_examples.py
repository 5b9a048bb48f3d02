"""The ``>>>`` examples in the public API's docstrings run and show what they print.

The modules checked are the public packages and every module that defines one of their exported
names (their ``__all__``), so an example added to a public class or function is run here without
being listed. Each example runs with ``doctest`` in a fresh copy of its module's globals; temporary
files go to the test's own directory.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import tempfile

import pytest

PUBLIC_PACKAGES = (
    "dattri_llm",
    "dattri_llm.gradient",
    "dattri_llm.attribution",
    "dattri_llm.utils",
    "dattri_llm.options",
    "dattri_llm.cli",
)
# the entry points whose examples the guides point to: each must keep a runnable one
MUST_HAVE_EXAMPLES = (
    "dattri_llm.gradient.hooks.manager.HookManager",
    "dattri_llm.gradient.callbacks.offload.OffloadCallback",
    "dattri_llm.gradient.sources.DiskGradientSource",
    "dattri_llm.attribution.tracin.TracInAttributor",
    "dattri_llm.attribution.index.gradient_index.GradientIndex",
)
# examples that need an optional extra: skipped, naming it, when it is not installed
NEEDS = {"dattri_llm.attribution.index.gradient_index.GradientIndex": "faiss"}
OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_modules() -> list[str]:
    """The public packages and the modules that define their exported names."""
    names = set(PUBLIC_PACKAGES)
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for attr in getattr(module, "__all__", ()):
            owner = inspect.getmodule(getattr(module, attr))
            if owner is not None and owner.__name__.startswith("dattri_llm"):
                names.add(owner.__name__)
    return sorted(names)


def collect() -> list[doctest.DocTest]:
    """Every docstring of those modules that holds at least one ``>>>`` example."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found: dict[str, doctest.DocTest] = {}
    for name in public_modules():
        for test in finder.find(importlib.import_module(name), name):
            if test.examples:
                found.setdefault(test.name, test)
    return sorted(found.values(), key=lambda t: t.name)


EXAMPLES = collect()


def test_the_entry_points_have_examples() -> None:
    collected = {t.name for t in EXAMPLES}
    missing = [name for name in MUST_HAVE_EXAMPLES if name not in collected]
    assert not missing, f"no runnable >>> example found for {missing}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example_runs(
    example: doctest.DocTest, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    if example.name in NEEDS:
        pytest.importorskip(NEEDS[example.name])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # mkdtemp() under the test's dir
    runner = doctest.DocTestRunner(optionflags=OPTIONFLAGS)
    report: list[str] = []
    runner.run(example, out=report.append, clear_globs=True)
    assert runner.failures == 0, "".join(report)
