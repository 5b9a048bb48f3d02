"""Capture callbacks: one file per callback, registered here."""

from __future__ import annotations

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.callbacks.capture import CaptureCallback

__all__ = ["HookCallback", "CaptureCallback"]
