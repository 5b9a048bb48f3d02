"""The callback protocol of the :class:`~dattri_llm.HookManager`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["HookCallback"]


class HookCallback:
    """Base class of capture callbacks; override the hook points you need.

    Order of calls: ``on_register`` once; per collection context ``on_context_start`` …
    ``on_context_end``; inside it, per layer call ``on_forward`` and ``on_backward``, and once per
    completed backward pass ``on_step_end(record)`` (after ``param.grad`` is accumulated, before
    the optimizer step); ``on_remove`` when the manager is removed.
    """

    manager: CaptureHost | None = None

    def on_register(self, manager: CaptureHost) -> None:
        """Called when the manager is built."""
        self.manager = manager

    def on_context_start(self) -> None:
        """Called when ``manager.collect()`` is entered."""

    def on_forward(self, layer: str, module: nn.Module, a: torch.Tensor) -> None:
        """Called in each hooked layer's forward with its ``a`` factor."""

    def on_backward(self, layer: str, module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> None:
        """Called when a hooked layer's output gradient arrives, with both factors."""

    def on_step_end(self, record: GradientRecord) -> None:
        """Called once per completed backward pass with the assembled record."""

    def on_context_end(self) -> None:
        """Called when ``manager.collect()`` exits (flush buffers here)."""

    def on_remove(self) -> None:
        """Called when the manager's hooks are removed."""
