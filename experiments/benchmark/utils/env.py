"""Process setup (one thread: :func:`ensure_env`) and the header every benchmark prints."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path

__all__ = ["ensure_env", "header", "BENCH_DIR", "RESULTS_DIR"]

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where result files go: ``experiments/benchmark/results`` unless ``DATTRI_BENCH_RESULTS`` says
#: otherwise (the quick runs of the smoke test, which leave the committed results alone).
RESULTS_DIR = Path(os.environ.get("DATTRI_BENCH_RESULTS") or os.path.join(BENCH_DIR, "results"))
_MARK = "_DATTRI_BENCH_ENV"


def ensure_env(python: str | None = None) -> None:
    """Re-exec the script with ``OMP_NUM_THREADS=1`` before torch is imported; ``python`` moves
    it into a peer's venv (made with ``--system-site-packages``: the peer in our process)."""
    if os.environ.get(_MARK) == "1":
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", _MARK: "1"}
    exe = python or sys.executable
    os.execve(exe, [exe, *sys.argv], env)


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:  # Linux only, as utils/memory.py
        lines = [ln for ln in f if ln.startswith("model name")]
    return lines[0].split(":", 1)[1].strip() if lines else platform.processor()


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
    lines += [f"- {k}: {v}" for k, v in (extra or {}).items()]
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
