"""Peak memory of a call on CPU, from the kernel's resident-set high-water mark.

Method (Linux): ``malloc_trim(0)`` hands freed heap pages back to the OS, writing ``5`` to
``/proc/self/clear_refs`` resets the high-water mark ``VmHWM`` to the current resident set, the
call runs, and the peak is ``VmHWM`` minus the resident set before the call. This counts every
byte the process touches (torch tensors, Python objects, library buffers) with no sampling gap;
tracemalloc would miss torch's C++ allocations and ``ru_maxrss`` cannot be reset. The figure
is the extra memory of the call over what was already live (model, inputs, kept records).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

__all__ = ["peak_rss_bytes", "rss_bytes", "memory_method_ok", "status_bytes"]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover - non-glibc systems
    _LIBC = None


def status_bytes(key: str) -> int:
    """A size field of ``/proc/self/status`` in bytes: ``VmHWM`` is this process image's peak
    (reset by exec, unlike ``ru_maxrss``, which counts the parent's pages copied at fork)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss_bytes() -> int:
    """Current resident set size in bytes."""
    return status_bytes("VmRSS")


def peak_rss_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Run ``fn`` and return (peak resident bytes above the level before it, its result)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss_bytes()
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
