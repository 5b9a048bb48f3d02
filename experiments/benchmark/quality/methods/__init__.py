"""Method adapters: each turns the reference checkpoints into an (n_train, n_test) score matrix.

A method raises :class:`Skipped` when it does not apply to the setting (with the reason).
"""

from __future__ import annotations

import contextlib
import io
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from experiments.benchmark.quality.common import Setting


class Skipped(Exception):
    """The method does not apply to this setting (message = why)."""


@dataclass
class Context:
    """What every method sees: the setting and the reference run's checkpoints."""

    setting: Setting
    checkpoints: list[dict[str, torch.Tensor]]
    quick: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, torch.Tensor]:
        return self.checkpoints[-1]

    @property
    def trajectory(self) -> list[dict[str, torch.Tensor]]:
        """The checkpoints stored during training (``setting.checkpoint_epochs``), without the
        extra copy of the final model that the reference run appends."""
        return self.checkpoints[: len(self.setting.checkpoint_epochs)]

    def model(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        m = self.setting.make_model()
        m.load_state_dict(self.final if state is None else state)
        m.eval()
        return m


@dataclass
class Method:
    """One row of the table."""

    name: str
    source: str
    fn: Callable[[Context], torch.Tensor]
    note: str = ""
    quiet: bool = False


@dataclass
class MethodResult:
    name: str
    source: str
    status: str  # ok | skipped | error
    scores: torch.Tensor | None = None
    seconds: float = 0.0
    note: str = ""
    #: Peak resident memory of the call above the level before it (MB; see
    #: ``experiments/benchmark/utils/memory.py``); ``None`` where it was not measured.
    peak_mb: float | None = None


def run_method(method: Method, ctx: Context) -> MethodResult:
    """Run one adapter, timing it, measuring its peak resident memory (the kernel's VmHWM
    over the call, above the resident set before it) and turning missing code / errors into a
    status. An adapter may add to its note through ``ctx.extra["last_note"]``."""
    from experiments.benchmark.utils.memory import peak_rss_bytes

    n_train, n_test = len(ctx.setting.train), len(ctx.setting.test)
    ctx.extra.pop("last_note", None)

    def call() -> torch.Tensor:
        if method.quiet:  # peers print a tqdm bar per batch: keep the table readable
            with contextlib.redirect_stderr(io.StringIO()):
                return method.fn(ctx)
        return method.fn(ctx)

    def measured() -> tuple[float | None, torch.Tensor]:
        if not _can_reset_peak():
            return None, call()
        peak, out = peak_rss_bytes(call)
        return peak / 1e6, out

    t0 = time.perf_counter()
    try:
        peak_mb, scores = measured()
    except Skipped as e:
        return MethodResult(method.name, method.source, "skipped", note=str(e))
    except Exception as e:  # noqa: BLE001 - a failing peer must not sink the whole table
        traceback.print_exc()
        return MethodResult(method.name, method.source, "error", note=f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    extra = ctx.extra.pop("last_note", "")
    note = "; ".join(n for n in (method.note, extra) if n)
    scores = scores.detach().to(torch.float64).cpu()
    assert tuple(scores.shape) == (n_train, n_test), (method.name, tuple(scores.shape))
    return MethodResult(method.name, method.source, "ok", scores, seconds, note, peak_mb)


def _can_reset_peak() -> bool:
    """Whether the resident-set high-water mark can be reset here (Linux, writable procfs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True
