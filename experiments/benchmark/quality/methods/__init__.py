"""Method adapters: each turns the reference checkpoints into an (n_train, n_test) score matrix,
or raises :class:`Skipped` with the reason it does not apply to the setting."""

from __future__ import annotations

import contextlib
import io
import os
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
    """What every method sees: the setting and the reference run's checkpoints (the stored
    ones, then the final model)."""

    setting: Setting
    checkpoints: list[dict[str, torch.Tensor]]
    quick: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, torch.Tensor]:
        return self.checkpoints[-1]

    @property
    def trajectory(self) -> list[dict[str, torch.Tensor]]:
        """The checkpoints stored during training (``setting.checkpoint_epochs``)."""
        return self.checkpoints[: len(self.setting.checkpoint_epochs)]

    def model(self, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        m = self.setting.make_model()
        m.load_state_dict(self.final if state is None else state)
        return m.eval()


@dataclass
class Method:
    """One row of the table (``quiet``: its stderr is dropped, for peers' progress bars)."""

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
    peak_mb: float | None = None  # resident-set peak of the call above the level before it


def run_method(method: Method, ctx: Context) -> MethodResult:
    """Run one adapter, timed, with its peak resident memory; a skip or an error becomes the
    row's status. An adapter may add to its note through ``ctx.extra["last_note"]``."""
    from experiments.benchmark.utils.memory import peak_rss_bytes

    ctx.extra.pop("last_note", None)

    def call() -> torch.Tensor:
        quiet = contextlib.redirect_stderr(io.StringIO())
        with quiet if method.quiet else contextlib.nullcontext():
            return method.fn(ctx)

    t0 = time.perf_counter()
    try:
        # the resident-set peak needs a resettable high-water mark (Linux procfs)
        peak, scores = peak_rss_bytes(call) if _PEAK else (None, call())
    except Skipped as e:
        return MethodResult(method.name, method.source, "skipped", note=str(e))
    except Exception as e:  # noqa: BLE001 - a failing peer must not sink the whole table
        traceback.print_exc()
        return MethodResult(method.name, method.source, "error", note=f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    note = "; ".join(n for n in (method.note, ctx.extra.pop("last_note", "")) if n)
    scores = scores.detach().to(torch.float64).cpu()
    assert scores.shape == (len(ctx.setting.train), len(ctx.setting.test)), method.name
    peak_mb = None if peak is None else peak / 1e6
    return MethodResult(method.name, method.source, "ok", scores, seconds, note, peak_mb)


_PEAK = os.access("/proc/self/clear_refs", os.W_OK)
