"""Optimizer knowledge: supported kinds, state laid out like captured gradients, preconditioning."""

from __future__ import annotations

from dattri_llm.gradient.optim.kinds import SUPPORTED_OPTIMIZERS, ParamHyper
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts
from dattri_llm.gradient.optim.precondition import Preconditioner

__all__ = ["SUPPORTED_OPTIMIZERS", "ParamHyper", "LayerLayout", "layer_layouts", "Preconditioner"]
