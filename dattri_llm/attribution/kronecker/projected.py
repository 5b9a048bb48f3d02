"""``ProjectedFisherAttributor``: influence with each layer's exact Fisher in its captured space.

``score(z, q) = sum_l m_l(q)^T (F_l + λ I)^{-1} m_l(z)`` with ``m_l`` a layer's flattened
per-sample gradient as captured (``proj_dim`` numbers for a ``"dense"`` / ``"sparse"`` /
``"mask"`` projection, ``k * d`` for ``"logra"``, ``K * D`` for an unprojected layer) and
``F_l = (1/N) sum_n m_l(z_n) m_l(z_n)^T`` its exact empirical Fisher: no Kronecker or
diagonal approximation, only the block-diagonal one across layers. Damping as K-FAC's
(absolute, or a factor of ``tr(F_l) / P``).

It is what :class:`KFACAttributor` / :class:`EKFACAttributor` already do on a vector
projection; this class applies it to every layer, whatever form the store holds: notably a
compact ``"logra"`` store (each layer its ``k x d`` projected gradient), from which a K-FAC fit
is impossible without the factors. A layer of more than ``max_dim`` numbers per sample is
refused (its ``P x P`` Fisher would not be small); project it.

Implementation: every layer is read as a vector layer (``projected.vector``, matrix form
``(1, P)``), for which the Kronecker machinery is exact (``G = 1``, ``A = F``), so fitting,
persistence, damping, distributed all-reduce and :meth:`preconditioner` are K-FAC's; so are
``normalized_grad`` and ``second_moment`` (TrackStar's optimizer correction, applied to each
layer before its vector view: :mod:`dattri_llm.attribution.kronecker.second_moment`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.kronecker.kfac import KFACAttributor
from dattri_llm.attribution.kronecker.preconditioner import FisherPreconditioner
from dattri_llm.attribution.kronecker.second_moment import ViewedBlocks
from dattri_llm.gradient.gradient import Gradient, Materialized
from dattri_llm.gradient.layers import get_rule

__all__ = ["ProjectedFisherAttributor", "vector_view", "DEFAULT_MAX_DIM"]

#: Largest layer (numbers per sample) fitted by default: an 8192 x 8192 float64 Fisher is 512 MB.
DEFAULT_MAX_DIM = 8192

_VECTOR = "projected.vector"


def vector_view(gradient: Gradient, max_dim: int = DEFAULT_MAX_DIM) -> Gradient:
    """Every layer of ``gradient`` as a ``(B, P)`` vector layer (row-major matrix form).

    Raises:
        ValueError: a layer with more than ``max_dim`` numbers per sample, naming it and the fix.
    """
    out = {}
    for name, lg in gradient.layers.items():
        try:
            rule = get_rule(lg.layer_type)
        except ValueError:  # no rule (a param_grad layer): it is held dense already
            rule = None
        if rule is not None and rule.exact_fisher:
            out[name] = lg
            continue
        if rule is None:
            size = int(lg.materialize().data.reshape(lg.batch_size, -1).shape[1])
        else:
            size = math.prod(rule.matrix_shape(lg.module_kwargs))
        if size > max_dim:
            raise ValueError(
                f"layer {name!r} ({lg.layer_type}) has {size} numbers per sample, more than "
                f"max_dim={max_dim}: its exact Fisher would be {size} x {size}. Capture it with "
                "a projection (HookManagerConfig(projection=ProjectionConfig(...))), leave it "
                "out (layers=[...]), raise max_dim, or use KFACAttributor / EKFACAttributor."
            )
        kw = {"_d": size, "source_layer_type": lg.layer_type}
        out[name] = Materialized(lg.materialize().data.reshape(lg.batch_size, size), _VECTOR, kw)
    return Gradient(out)


@dataclass(frozen=True)
class _ViewPreconditioner(FisherPreconditioner):
    """A :class:`FisherPreconditioner` reading each layer through :func:`vector_view`."""

    max_dim: int = DEFAULT_MAX_DIM

    def precondition_gradient(self, gradient: Gradient) -> Gradient:
        view = vector_view(gradient, self.max_dim)
        return self.factors.precondition(view, self.damping, self.relative)

    __call__ = precondition_gradient


class ProjectedFisherAttributor(KFACAttributor):
    """Influence with each layer's exact Fisher in its captured (projected) space.

    ``score = sum_l m_test^T (F_l + λ I)^{-1} m_train`` with ``F_l = (1/N) sum_n m_n m_n^T``
    over each layer's flattened captured gradient (see the module docstring). Fit, damping
    (``damping=None``: 0.1 x ``tr(F_l) / P``; a number: absolute, ``relative=True``: a factor of
    ``tr(F_l) / P``), persistence and :meth:`preconditioner` are :class:`KFACAttributor`'s; the
    fit is made from training gradients (a store, a source or a live dataset), not from
    ``KroneckerCovarianceCallback`` covariances. Sample granularity only.

    Example:
        ```python
        att = ProjectedFisherAttributor(AttributionArguments(output_dir="scores"))
        score = att.attribute_from_cache("train_grads", "test_grads")  # compact logra
        ```

    Args:
        args: Run options.
        task: For the live path.
        max_dim: Largest layer (numbers per sample) to fit; larger ones are refused.
        eigen_dtype: Eigendecomposition dtype (float64 by default).
        mode: Routing of the inner products.
        normalized_grad: The cosine after preconditioning,
            ``m_qᵀ P m_z / (√(m_zᵀ P m_z) √(m_qᵀ P m_q))`` (see :class:`KFACAttributor`).
        second_moment: TrackStar's optimizer correction: a ``SecondMoment`` (or one per
            checkpoint) multiplying each coordinate by ``1/√(v + ε)`` before the fit and the
            scores, so ``F_l`` is the exact Fisher of the corrected gradients and the score
            ``m̃_qᵀ (F̃_l + λ I)^{-1} m̃_z``. Raw layers or a ``"mask"`` projection only
            (``"dense"`` / ``"sparse"`` / ``"logra"`` are refused: the correction must precede a
            mixing projection). See :mod:`dattri_llm.attribution.kronecker.second_moment`.
        damping: ``λ`` (see above; a call may pass its own).
        relative: Scale ``damping`` by ``tr(F_l) / P`` (a call may pass its own).
        repeats: As :class:`KFACAttributor`'s.
    """

    kind: ClassVar[str] = "kfac"

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        max_dim: int = DEFAULT_MAX_DIM,
        eigen_dtype: torch.dtype = torch.float64,
        mode: str = "auto",
        normalized_grad: bool = False,
        second_moment: Any = None,
        damping: float | None = None,
        relative: bool | None = None,
        repeats: str | None = None,
    ) -> None:
        super().__init__(
            args,
            task,
            repeats=repeats,
            eigen_dtype=eigen_dtype,
            mode=mode,
            normalized_grad=normalized_grad,
            second_moment=second_moment,
            damping=damping,
            relative=relative,
        )
        if isinstance(max_dim, bool) or not isinstance(max_dim, int) or max_dim < 1:
            raise ValueError(f"max_dim must be a positive int, got {max_dim!r}.")
        self.max_dim = max_dim

    def _fit(
        self,
        train_source: Any,
        covariances: Any,
        hook_config: Any,
        collate_fn: Any,
        query_source: Any = None,
    ) -> Any:
        # mix is always 0 here (not an option of this class): the query side is not needed
        if covariances is not None:
            raise ValueError(
                "ProjectedFisherAttributor fits each layer's exact Fisher from the training "
                "gradients (train_source); Kronecker covariances (covariances=...) cannot give "
                "it. Use KFACAttributor / EKFACAttributor with covariances."
            )
        return super()._fit(train_source, None, hook_config, collate_fn)

    def _fit_settings(self) -> tuple:
        """K-FAC's, and ``max_dim`` (a fit over other layers' views is another fit)."""
        return (*super()._fit_settings(), self.max_dim)

    def _as_source(self, train_source: Any, hook_config: Any, collate_fn: Any) -> Any:
        source = super()._as_source(train_source, hook_config, collate_fn)
        if source is None:
            return None
        return ViewedBlocks(source, lambda g, c: self._score_view(g, c, g.layer_names))

    def _fit_blocks(self, source: Any, stage: str) -> Any:
        return source  # corrected (second_moment) before the vector view, in _as_source

    def _score_view(self, gradient: Gradient, checkpoint: int, names: Iterable[str]) -> Gradient:
        """Every layer as a vector layer, corrected first (``second_moment``) on ``names``."""
        return vector_view(super()._score_view(gradient, checkpoint, names), self.max_dim)

    def _moment_preconditioner(
        self, p: FisherPreconditioner, checkpoint: int
    ) -> FisherPreconditioner:
        """The damped inverse (see :meth:`KFACAttributor.preconditioner`), on any layer form."""
        view = _ViewPreconditioner(p.factors, p.damping, p.relative, p.checkpoint, self.max_dim)
        return super()._moment_preconditioner(view, checkpoint)
