"""The registry, and every benchmark's quick run (``slow``: each in its own process, as a reader
would start it) exits cleanly with its report on stdout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.benchmark import suite

ROOT = suite.ROOT


def test_registry_names_scripts_and_pages_that_exist():
    """Each entry's module is a file under ``experiments/`` and its docs page exists, and a
    name is listed once: ``--list`` and the docs cannot point at a removed script."""
    names = [b.name for b in suite.BENCHMARKS]
    assert len(names) == len(set(names))
    for b in suite.BENCHMARKS:
        assert (ROOT / "experiments" / (b.module.replace(".", "/") + ".py")).is_file(), b.name
        assert (ROOT / "docs" / b.page).is_file(), b.page


def test_command_passes_the_quick_arguments_then_the_extra_ones():
    bench = suite.Benchmark("x", "benchmark.x", "BENCHMARKS.md", ("--quick", "--rounds", "1"))
    got = suite.command(bench, quick=True, extra=["--parts", "a"])[1:]
    assert got == "-m experiments.benchmark.x --quick --rounds 1 --parts a".split()
    assert suite.command(bench, quick=False)[1:] == ["-m", "experiments.benchmark.x"]


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="unknown benchmark 'nope': expected 'all' or one of "):
        suite.main(["nope"])


#: quick runs that start several ``gloo`` processes (scale's 1 vs 2 ranks)
DISTRIBUTED = {"scale"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(b.name, marks=[pytest.mark.distributed] if b.name in DISTRIBUTED else [])
        for b in suite.BENCHMARKS
    ],
)
def test_quick_run(name, tmp_path):
    """``python -m experiments.benchmark NAME --quick --out DIR`` exits 0 and writes its report
    (its result files go to ``DIR`` too: the committed results stay as they are)."""
    bench = next(b for b in suite.BENCHMARKS if b.name == name)
    missing = suite.missing_needs(bench)
    if missing:
        pytest.skip(f"{name} needs {', '.join(missing)}")
    cmd = [sys.executable, "-m", "experiments.benchmark", name, "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / f"{name}.md").read_text().strip(), proc.stderr[-4000:]
