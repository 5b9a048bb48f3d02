"""Optimizer knowledge: supported kinds, state laid out like captured gradients, capture maps.

The capture-time maps: LESS's update direction and TrackStar's second-moment correction (the
latter imported on first use: recording optimizer state never loads it).
"""

from __future__ import annotations

from typing import Any

from dattri_llm.gradient.optim.kinds import SUPPORTED_OPTIMIZERS, ParamHyper
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts
from dattri_llm.gradient.optim.precondition import Preconditioner

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "ParamHyper",
    "LayerLayout",
    "layer_layouts",
    "Preconditioner",
    "SecondMomentPreconditioner",
]


def __getattr__(name: str) -> Any:
    if name == "SecondMomentPreconditioner":
        from dattri_llm.gradient.optim.second_moment import SecondMomentPreconditioner

        return SecondMomentPreconditioner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
