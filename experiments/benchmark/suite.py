"""Every benchmark behind one command: which script makes which docs table, and its quick run.

    python -m experiments.benchmark --list                  # name, script, docs page
    python -m experiments.benchmark NAME [--quick]          # the full run (the page's) / CI-sized
    python -m experiments.benchmark all --quick --out DIR   # every quick run, DIR/<name>.md each
    python -m experiments.benchmark tracin -- --parts floor # arguments after -- go to the script

Each runs in a fresh process with ``OMP_NUM_THREADS=1``, tables on stdout, progress on stderr;
``--out DIR`` also sends its result files to ``DIR`` (``DATTRI_BENCH_RESULTS``). ``--quick``
passes the registry's ``quick`` arguments (seconds on a 2-core machine, no peer needed); a
benchmark whose ``needs`` are not installed is left out with a note.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.benchmark.utils.timing import run_timed

__all__ = ["BENCHMARKS", "Benchmark", "command", "main", "missing_needs", "run"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Benchmark:
    """A module under ``experiments``, its docs page, quick arguments and needed modules."""

    name: str
    module: str
    page: str
    quick: tuple[str, ...] = ("--quick",)
    needs: tuple[str, ...] = ()


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("capture", "benchmark.capture", "benchmarks/capture.md"),
    Benchmark("fixed_weights", "benchmark.fixed_weights", "benchmarks/capture.md"),
    # bergson runs in its own venv ($DATTRI_LLM_BERGSON_PYTHON): without one it prints a note
    Benchmark("posthoc_bergson", "benchmark.posthoc_bergson", "benchmarks/capture.md"),
    Benchmark("offload_overhead", "benchmark.offload_overhead", "benchmarks/capture.md"),
    Benchmark("moe", "benchmark.moe", "benchmarks/capture.md"),
    # dattri's as-shipped (projected) run is the slow one on CPU: the quick run skips it
    Benchmark("tracin", "benchmark.tracin", "benchmarks/peers.md", ("--quick", "--no-projected")),
    Benchmark("tracin_floor", "benchmark.tracin_floor", "benchmarks/scoring.md"),
    # CUDA when there is one (the docs' table), else the same parts on the CPU
    Benchmark("gpu_floor", "benchmark.gpu_floor", "benchmarks/gpu.md"),
    Benchmark("scale", "benchmark.scale", "benchmarks/scoring.md"),
    Benchmark(
        "store_open",
        "benchmark.store_open",
        "benchmarks/scoring.md",
        ("--n", "2000", "--rounds", "1"),
    ),
    Benchmark(
        "scoring_limit",
        "benchmark.scoring_limit",
        "benchmarks/scoring.md",
        ("--n", "2000", "--dim", "256", "--layers", "2", "--queries", "10", "--general"),
    ),
    Benchmark(
        "kfac_vs_kronfluence",
        "benchmark.kfac_vs_kronfluence",
        "benchmarks/peers.md",
        ("--quick", "--no-scaling"),
    ),
    Benchmark(
        "quality",
        "benchmark.quality.run",
        "benchmarks/quality.md",
        ("--setting", "digits-lr", "--quick", "--no-peers", "--methods", "^Grad-Dot$"),
    ),
    Benchmark(
        "tracing",
        "benchmark.tracing.run",
        "benchmarks/tracing.md",
        ("--quick", "--rows", "Grad-Dot", "random"),
    ),
    # reads the committed result files (no retraining); ``--write`` updates
    # experiments/benchmark/results/headline.md, which the quality page cites
    Benchmark(
        "headline",
        "benchmark.headline",
        "benchmarks/quality.md",
        ("--results", "experiments/benchmark/results"),
    ),
    Benchmark(
        "selection",
        "benchmark.selection.run",
        "benchmarks/selection.md",
        (
            "--quick",
            "--seeds",
            "1",
            "--methods",
            "Grad-Cos",
            "--pool-size",
            "200",
            "--n-test",
            "32",
            "--pretrain-windows",
            "200",
            "--pretrain-epochs",
            "1",
            "--warmup-epochs",
            "2",
            "--finetune-epochs",
            "2",
        ),
    ),
    # the quick run: steps 0-3 (capture, exact top_k, its limit, the index) on 2,000 windows
    Benchmark("million", "benchmark.million", "benchmarks/index.md", needs=("faiss",)),
    Benchmark(
        "serve",
        "benchmark.serve",
        "benchmarks/serve.md",
        ("--quick", "--docs", "12", "--sizes", "12,600", "--queries", "2", "--requests", "1")
        + ("--clients", "1,2"),
        needs=("starlette", "uvicorn"),
    ),
    Benchmark("fidelity", "fidelity.run", "benchmarks/capture.md", needs=("olmo_core",)),
)


def missing_needs(bench: Benchmark) -> list[str]:
    """The modules ``bench`` needs that are not installed here."""
    return [m for m in bench.needs if importlib.util.find_spec(m) is None]


def command(bench: Benchmark, quick: bool, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line that runs ``bench`` (its quick arguments with ``quick``)."""
    args = list(bench.quick) if quick else []
    return [sys.executable, "-m", f"experiments.{bench.module}", *args, *extra]


def run(
    bench: Benchmark, quick: bool, extra: list[str], out: Path | None
) -> tuple[int, float, float]:
    """Run ``bench`` in a fresh single-threaded process: its exit status, wall-clock seconds
    and CPU seconds (the steadier figure on a shared machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = command(bench, quick, extra)
    print(f"[suite] {bench.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)

    if out is None:
        res, wall, cpu = run_timed(cmd, cwd=ROOT, env=env)
    else:  # the result files the benchmark writes go beside its tables
        env.setdefault("DATTRI_BENCH_RESULTS", str(out))
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"{bench.name}.md", "w", encoding="utf-8") as f:
            res, wall, cpu = run_timed(cmd, cwd=ROOT, env=env, stdout=f)
    return res.returncode, wall, cpu


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m experiments.benchmark``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    p = argparse.ArgumentParser(prog="python -m experiments.benchmark", description=__doc__)
    p.add_argument("name", nargs="?", help="a benchmark's name, or 'all'")
    p.add_argument("--quick", action="store_true", help="the CI-sized run (seconds each)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and their pages")
    p.add_argument("--out", type=Path, help="DIR/<name>.md per benchmark, result files in DIR")
    args = p.parse_args(argv)
    if args.list or not args.name:
        for b in BENCHMARKS:
            print(f"{b.name:20} experiments/{b.module.replace('.', '/')}.py  docs/{b.page}")
        return 0
    todo = [b for b in BENCHMARKS if args.name in ("all", b.name)]
    if not todo:
        names = ", ".join(b.name for b in BENCHMARKS)
        raise SystemExit(f"unknown benchmark {args.name!r}: expected 'all' or one of {names}")
    failed = []
    for b in todo:
        missing = missing_needs(b)
        if missing:  # a peer or an optional stack: the rest of the suite still runs
            print(f"[suite] {b.name}: skipped, {', '.join(missing)} not installed", flush=True)
            continue
        rc, seconds, cpu = run(b, args.quick, extra, args.out)
        msg = f"[suite] {b.name}: exit {rc} in {seconds:.1f} s ({cpu:.1f} CPU-s)"
        print(msg, file=sys.stderr, flush=True)
        if rc:
            failed.append(b.name)
    if failed:
        print(f"[suite] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
