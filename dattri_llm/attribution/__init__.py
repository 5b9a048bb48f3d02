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

from dattri_llm.attribution.less import LESSAttributor  # noqa: E402

__all__ += ["LESSAttributor"]

from dattri_llm.attribution.adamw_influence import AdamWInfluenceAttributor  # noqa: E402
from dattri_llm.attribution.dvemb import DataValueEmbeddings, DVEmbAttributor  # noqa: E402
from dattri_llm.attribution.trajectory import TrajectoryAttributor  # noqa: E402

__all__ += ["TrajectoryAttributor", "AdamWInfluenceAttributor", "DVEmbAttributor"]
__all__ += ["DataValueEmbeddings"]

from dattri_llm.attribution.curvature import ExactHessian  # noqa: E402

__all__ += ["ExactHessian"]
