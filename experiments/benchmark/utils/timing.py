"""Timing: variants in interleaved rounds (order rotated each round, so a slow phase of the
shared machine hits all alike) after a warm-up; wall clock, process CPU time and peak memory
of every call. A ratio is the median over rounds of the per-round ratio (see the README)."""

from __future__ import annotations

import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .memory import peak_rss_bytes

__all__ = [
    "Variant",
    "Timing",
    "measure",
    "med",
    "time_interleaved",
    "time_once",
    "paired_ratio",
    "run_timed",
]


@dataclass
class Variant:
    """A timed variant: ``setup()`` and ``teardown()`` run untimed around each ``fn()``."""

    name: str
    fn: Callable[[], object]
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None
    #: Called with ``fn``'s result after each timed call, before ``teardown`` (untimed).
    after: Callable[[object], object] | None = None


@dataclass
class Timing:
    """Wall seconds, process CPU seconds (all threads) and peak bytes of each round."""

    name: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def measure(fn: Callable[[], object]) -> tuple[float, float, int, object]:
    """(wall s, process CPU s, peak bytes above the start, result) of one call of ``fn``."""
    box: dict[str, float] = {}

    def run() -> object:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        box["wall"], box["cpu"] = time.perf_counter() - t0, time.process_time() - c0
        return out

    peak, out = peak_rss_bytes(run)
    return box["wall"], box["cpu"], peak, out


def med(xs: list[float]) -> float | None:
    """The middle value (the upper one of an even count, as the docs' tables used); ``None``
    for no values."""
    return sorted(xs)[len(xs) // 2] if xs else None


def time_once(v: Variant) -> tuple[float, float, int]:
    """One timed call: (wall s, CPU s, peak bytes); setup / after / teardown untimed."""
    if v.setup is not None:
        v.setup()
    wall, cpu, peak, out = measure(v.fn)
    if v.after is not None:
        v.after(out)
    del out
    if v.teardown is not None:
        v.teardown()
    return wall, cpu, peak


def time_interleaved(
    variants: list[Variant], rounds: int, warmup: int = 1, log: Callable[[str], None] | None = None
) -> dict[str, Timing]:
    """Time every variant ``rounds`` times in rotated interleaved order after ``warmup`` calls."""
    for v in variants:
        for _ in range(warmup):
            time_once(v)
    out = {v.name: Timing(v.name) for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            t = out[v.name]
            wall, cpu, peak = time_once(v)
            t.times.append(wall)
            t.cpu.append(cpu)
            t.peaks.append(peak)
        if log is not None:
            last = (f"{v.name}={out[v.name].times[-1]:.3f}s/{out[v.name].cpu[-1]:.3f}cpu"
                    for v in variants)  # fmt: skip
            log(f"round {r + 1}/{rounds}: " + ", ".join(last))
    return out


def paired_ratio(num: Timing, den: Timing, cpu: bool = False) -> float:
    """Median over rounds of ``num / den`` (rounds are paired by index), wall or CPU time."""
    a, b = (num.cpu, den.cpu) if cpu else (num.times, den.times)
    return statistics.median(x / y for x, y in zip(a, b))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_timed(cmd: list[str], **kwargs: object) -> tuple[subprocess.CompletedProcess, float, float]:
    """``subprocess.run(cmd, **kwargs)``: its result, wall seconds and CPU seconds (the child
    process and its own children: the steadier figure on a shared machine)."""
    t0, c0 = time.perf_counter(), _children_cpu()
    res = subprocess.run(cmd, **kwargs)
    return res, time.perf_counter() - t0, _children_cpu() - c0
