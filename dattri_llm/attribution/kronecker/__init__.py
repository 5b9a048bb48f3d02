"""The Fisher attributors: influence through a fitted, damped ``(F̂ + λ I)^{-1}``.

``kfac`` (:class:`KFACAttributor`, :class:`EKFACAttributor`: the fit workflow, the scores and
loading saved fits), ``projected`` (:class:`ProjectedFisherAttributor`: each layer's exact
Fisher in its captured space), ``preconditioner`` (:class:`FisherPreconditioner`: a fit's damped
inverse for another query side; the damping argument's default and resolution), ``mixture``
(``mix=``: the fit on a train/query mixture) and ``second_moment`` (``second_moment=``: fit and
scores on optimizer-corrected gradients). The quantities they fit (covariances, eigenbases,
eigenvalue correction, their files) are :mod:`dattri_llm.gradient.kronecker`.
"""

from __future__ import annotations

from dattri_llm.attribution.kronecker.kfac import EKFACAttributor, KFACAttributor
from dattri_llm.attribution.kronecker.preconditioner import FisherPreconditioner
from dattri_llm.attribution.kronecker.projected import ProjectedFisherAttributor

__all__ = [
    "KFACAttributor",
    "EKFACAttributor",
    "ProjectedFisherAttributor",
    "FisherPreconditioner",
]
