"""Wall-clock timing with warm-up and interleaved repeats.

The machine is shared, so variants are timed in interleaved rounds (every variant once per
round, the order rotated each round): slow phases caused by other work hit all variants alike.
A variant's time is its median over rounds; a ratio is the median over rounds of the per-round
ratio to the baseline, which cancels most of the drift. Both wall-clock and process CPU time
(``time.process_time``: every thread of the process, none of the time spent waiting for a core)
are recorded; on a loaded machine the CPU-time ratios are the steadier figure for single-threaded
compute, the wall-clock ones are what a user waits (and include I/O waits).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .memory import peak_rss_bytes

__all__ = ["Variant", "Timing", "time_interleaved", "time_once", "paired_ratio"]


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
    """Seconds of each round for one variant."""

    name: str
    times: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    #: Peak resident bytes above the level before each call (see ``memory.py``).
    peaks: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_median(self) -> float:
        """Median process CPU time (all threads), less sensitive to other load than wall."""
        return statistics.median(self.cpu)

    @property
    def best(self) -> float:
        return min(self.times)


def time_once(v: Variant) -> tuple[float, float, int]:
    """One timed call: (wall s, process CPU s, peak bytes); setup/after/teardown untimed.

    The peak memory comes for free: the kernel's high-water mark is reset before the call.
    """
    if v.setup is not None:
        v.setup()
    box: dict[str, float] = {}

    def run() -> object:
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = v.fn()
        box["wall"] = time.perf_counter() - t0
        box["cpu"] = time.process_time() - c0
        return out

    peak, out = peak_rss_bytes(run)
    if v.after is not None:
        v.after(out)
    del out
    if v.teardown is not None:
        v.teardown()
    return box["wall"], box["cpu"], peak


def time_interleaved(
    variants: list[Variant], rounds: int, warmup: int = 1, log: Callable[[str], None] | None = None
) -> dict[str, Timing]:
    """Time every variant ``rounds`` times in rotated interleaved order after ``warmup`` calls."""
    for v in variants:
        for _ in range(warmup):
            time_once(v)
    out = {v.name: Timing(v.name) for v in variants}
    n = len(variants)
    for r in range(rounds):
        order = variants[r % n :] + variants[: r % n]
        for v in order:
            wall, cpu, peak = time_once(v)
            out[v.name].times.append(wall)
            out[v.name].cpu.append(cpu)
            out[v.name].peaks.append(peak)
        if log is not None:
            log(
                f"round {r + 1}/{rounds}: "
                + ", ".join(
                    f"{v.name}={out[v.name].times[-1]:.3f}s/{out[v.name].cpu[-1]:.3f}cpu"
                    for v in variants
                )
            )
    return out


def paired_ratio(num: Timing, den: Timing, cpu: bool = False) -> float:
    """Median over rounds of ``num / den`` (rounds are paired by index), wall or CPU time."""
    a, b = (num.cpu, den.cpu) if cpu else (num.times, den.times)
    return statistics.median(x / y for x, y in zip(a, b))
