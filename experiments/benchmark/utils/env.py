"""Process setup and the header every benchmark prints.

Benchmarks on the shared 2-core machines run single-threaded: :func:`ensure_env` re-executes
the script with ``OMP_NUM_THREADS=1`` (torch reads it at import) before torch is imported, and
:func:`header` then also calls ``torch.set_num_threads(1)`` and reports both.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

__all__ = ["ensure_env", "header", "BENCH_DIR", "RESULTS_DIR"]

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where benchmarks write their result files (JSON / Markdown): ``experiments/benchmark/results``
#: unless ``DATTRI_BENCH_RESULTS`` names another folder (the quick runs of the smoke test write
#: there, leaving the committed results alone). Caches stay under ``results/cache``.
RESULTS_DIR = Path(os.environ.get("DATTRI_BENCH_RESULTS") or os.path.join(BENCH_DIR, "results"))
_MARK = "_DATTRI_BENCH_ENV"


def ensure_env(python: str | None = None) -> None:
    """Re-exec the current script with ``OMP_NUM_THREADS=1`` (and ``python`` if given).

    Must be called before ``import torch``. ``python`` lets a script move into a peer's
    virtual environment (created with ``--system-site-packages``) so that peers run in the
    same process as our code.
    """
    if os.environ.get(_MARK) == "1":
        return
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env[_MARK] = "1"
    exe = python or sys.executable
    os.execve(exe, [exe, *sys.argv], env)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def header(title: str, extra: dict[str, str] | None = None) -> str:
    """Set one torch thread and return a markdown header with command line and versions."""
    import torch

    torch.set_num_threads(1)
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]]
    )
    lines = [
        f"## {title}",
        "",
        f"- command: `{cmd}`",
        f"- python {platform.python_version()} ({sys.executable}), torch {torch.__version__}, "
        f"{_versions()}",
        f"- threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"torch.get_num_threads()={torch.get_num_threads()} (set by the script)",
        f"- CPU: {_cpu_model()}, {os.cpu_count()} cores shared with other work; load average "
        f"at start {os.getloadavg()[0]:.2f}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M')}",
    ]
    for k, v in (extra or {}).items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("transformers", "dattri", "opacus"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)
