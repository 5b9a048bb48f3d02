"""Attribution: the user's contract, the attributor interface and one module per method.

Here: ``arguments`` (:class:`AttributionArguments`), ``task`` (:class:`AttributionTask`),
``score`` (:class:`AttributionScore`), ``base`` (:class:`BaseAttributor`, the interface every
method implements) and the methods ``tracin``, ``kronecker``, ``less``, ``adamw_influence``,
``dvemb``. Below: ``engine/`` (the score loop the methods run on), ``trajectory/`` (the
machinery of the methods that replay a training run), ``views/`` (HTML report, token
heatmaps) and ``index/`` (nearest-neighbour search over a projected store, FAISS).
``docs/ARCHITECTURE.md`` is the map.
"""

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

from dattri_llm.attribution.kronecker import (  # noqa: E402
    EKFACAttributor,
    KFACAttributor,
    ProjectedFisherAttributor,
)

__all__ += ["KFACAttributor", "EKFACAttributor"]
__all__ += ["ProjectedFisherAttributor"]

from dattri_llm.attribution.less import LESSAttributor  # noqa: E402

__all__ += ["LESSAttributor"]

from dattri_llm.attribution.adamw_influence import AdamWInfluenceAttributor  # noqa: E402
from dattri_llm.attribution.dvemb import DataValueEmbeddings, DVEmbAttributor  # noqa: E402
from dattri_llm.attribution.trajectory.base import TrajectoryAttributor  # noqa: E402

__all__ += ["TrajectoryAttributor", "AdamWInfluenceAttributor", "DVEmbAttributor"]
__all__ += ["DataValueEmbeddings"]

from dattri_llm.attribution.trajectory.curvature import ExactHessian  # noqa: E402
from dattri_llm.attribution.trajectory.training import LiveRunArguments  # noqa: E402

__all__ += ["ExactHessian", "LiveRunArguments"]

from dattri_llm.attribution.normalization import SecondMoment  # noqa: E402

__all__ += ["SecondMoment"]

from dattri_llm.attribution.index import GradientIndex  # noqa: E402

__all__ += ["GradientIndex"]
