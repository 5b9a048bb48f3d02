"""Hook registration and layer selection."""

from __future__ import annotations

from dattri_llm.gradient.hooks.config import REGISTER_ALL, HookManagerConfig, LayerSpec
from dattri_llm.gradient.hooks.manager import HookManager

__all__ = ["REGISTER_ALL", "HookManagerConfig", "HookManager", "LayerSpec"]
