"""Capture callbacks: one file per callback, registered here."""

from __future__ import annotations

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.callbacks.capture import CaptureCallback
from dattri_llm.gradient.callbacks.data_selection import DataSelectionCallback
from dattri_llm.gradient.callbacks.kronecker import KroneckerCovarianceCallback
from dattri_llm.gradient.callbacks.offload import OffloadCallback
from dattri_llm.gradient.callbacks.optimizer_state import OptimizerStateCallback
from dattri_llm.gradient.callbacks.parameter_snapshot import ParameterSnapshotCallback

__all__ = ["HookCallback", "CaptureCallback", "OffloadCallback"]
__all__ += ["KroneckerCovarianceCallback"]
__all__ += ["DataSelectionCallback"]
__all__ += ["OptimizerStateCallback", "ParameterSnapshotCallback"]
