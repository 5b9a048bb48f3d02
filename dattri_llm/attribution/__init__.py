"""Attribution: arguments, tasks, scores, the shared score loop and the attributors."""

from __future__ import annotations

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor
from dattri_llm.attribution.score import AttributionScore, TopK
from dattri_llm.attribution.task import AttributionTask
from dattri_llm.attribution.tracin import TracInAttributor

__all__ = [
    "AttributionArguments",
    "AttributionTask",
    "AttributionScore",
    "TopK",
    "BaseAttributor",
    "TracInAttributor",
]

from dattri_llm.attribution.kronecker import EKFACAttributor, KFACAttributor  # noqa: E402

__all__ += ["KFACAttributor", "EKFACAttributor"]
