"""The gradient system: data model, layer rules, ops, hooks, callbacks, store and sources."""

from __future__ import annotations

from dattri_llm.gradient.callbacks import CaptureCallback, HookCallback
from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    LayerGradient,
    Materialized,
    Shared,
)
from dattri_llm.gradient.hooks import REGISTER_ALL, HookManager, HookManagerConfig
from dattri_llm.gradient.layers import get_rule, register_rule, supported_layer_types

__all__ = [
    "Factorized",
    "Materialized",
    "Shared",
    "LayerGradient",
    "Gradient",
    "GradientRecord",
    "HookManager",
    "HookManagerConfig",
    "REGISTER_ALL",
    "HookCallback",
    "CaptureCallback",
    "get_rule",
    "register_rule",
    "supported_layer_types",
]
