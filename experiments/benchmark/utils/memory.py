"""Peak memory of a call on CPU (Linux): the kernel's resident-set high-water mark ``VmHWM``,
reset through ``/proc/self/clear_refs`` after ``malloc_trim(0)``, minus the resident set before
the call (every byte touched, torch's C++ allocations included; see the benchmarks' README)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

__all__ = ["peak_rss_bytes", "memory_method_ok", "status_bytes"]


def status_bytes(key: str) -> int:
    """A size field of ``/proc/self/status`` in bytes: ``VmHWM`` is this process image's peak
    (reset by exec, unlike ``ru_maxrss``, which counts the parent's pages copied at fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Run ``fn`` and return (peak resident bytes above the level before it, its result)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: a fair baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_bytes("VmRSS")
    out = fn()
    peak = status_bytes("VmHWM") - before
    return peak, out


def memory_method_ok() -> tuple[bool, float]:
    """Self-check: a transient 100 MB tensor must read as ~100 MB. Returns (ok, measured MB)."""
    import torch

    def touch() -> None:
        x = torch.ones(25_000_000)  # 100 MB of float32
        del x

    try:
        peak, _ = peak_rss_bytes(touch)
    except OSError:
        return False, float("nan")
    mb = peak / 1e6
    return 95.0 <= mb <= 110.0, mb
