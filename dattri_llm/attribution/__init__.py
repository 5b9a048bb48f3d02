"""Attribution: the user's contract, the attributor interface and one module per method.

Here: ``arguments`` (:class:`AttributionArguments`), ``task`` (:class:`AttributionTask`),
``score`` (:class:`AttributionScore`), ``base`` (:class:`BaseAttributor`, the interface every
method implements and the one road every call takes), ``normalization`` (the gradient
normalizations the methods share) and the methods ``tracin``, ``less``, ``adamw_influence``,
``dvemb``. Below: ``kronecker/`` (K-FAC, EK-FAC, the projected Fisher), ``engine/`` (the score
loop the methods run on), ``trajectory/`` (the machinery of the methods that replay a training
run), ``views/`` (HTML report, token heatmaps) and ``index/`` (nearest-neighbour search over a
projected store, FAISS imported lazily). ``docs/ARCHITECTURE.md`` is the map.
"""

from __future__ import annotations

from dattri_llm.attribution.adamw_influence import AdamWInfluenceAttributor
from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor
from dattri_llm.attribution.dvemb import DataValueEmbeddings, DVEmbAttributor
from dattri_llm.attribution.index import GradientIndex
from dattri_llm.attribution.kronecker import (
    EKFACAttributor,
    KFACAttributor,
    ProjectedFisherAttributor,
)
from dattri_llm.attribution.less import LESSAttributor
from dattri_llm.attribution.normalization import SecondMoment
from dattri_llm.attribution.score import AttributionScore, TopK
from dattri_llm.attribution.task import AttributionTask
from dattri_llm.attribution.tracin import TracInAttributor
from dattri_llm.attribution.trajectory.base import TrajectoryAttributor
from dattri_llm.attribution.trajectory.curvature import ExactHessian
from dattri_llm.attribution.trajectory.training import LiveRunArguments

__all__ = [
    "AdamWInfluenceAttributor",
    "AttributionArguments",
    "AttributionScore",
    "AttributionTask",
    "BaseAttributor",
    "DVEmbAttributor",
    "DataValueEmbeddings",
    "EKFACAttributor",
    "ExactHessian",
    "GradientIndex",
    "KFACAttributor",
    "LESSAttributor",
    "LiveRunArguments",
    "ProjectedFisherAttributor",
    "SecondMoment",
    "TopK",
    "TracInAttributor",
    "TrajectoryAttributor",
]
