"""Optimizer knowledge: supported kinds, state laid out like captured gradients, capture maps.

The capture-time maps: LESS's update direction and TrackStar's second-moment correction.
"""

from __future__ import annotations

from dattri_llm.gradient.optim.kinds import SUPPORTED_OPTIMIZERS, ParamHyper
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts
from dattri_llm.gradient.optim.precondition import Preconditioner
from dattri_llm.gradient.optim.second_moment import SecondMomentPreconditioner

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "ParamHyper",
    "LayerLayout",
    "layer_layouts",
    "Preconditioner",
    "SecondMomentPreconditioner",
]
