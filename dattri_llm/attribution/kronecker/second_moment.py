"""TrackStar's second-moment correction for the Fisher family (``second_moment=``).

TrackStar (Chang et al., 2024) scores ``cos(R^{-1/2} g̃, R^{-1/2} q̃)`` with ``g̃ = g / √(v + ε)``
per coordinate (``v`` Adam's second moment, :class:`SecondMoment`) and ``R`` the second-moment
matrix of the *corrected* train gradients. With ``second_moment=`` the Fisher attributors
(:class:`KFACAttributor`, :class:`EKFACAttributor`, :class:`ProjectedFisherAttributor`) fit and
score on corrected gradients, defined exactly as follows, with ``D = diag(1/√(v + ε))`` and
``g̃ = D g`` (a layer's matrix form flattened row-major, as ``v`` is laid out):

* **Vector layers** (every layer of ``ProjectedFisherAttributor``; a ``"mask"`` projection under
  K-FAC / EK-FAC): the exact Fisher of the corrected gradients, ``F̃ = (1/N) Σ_n g̃_n g̃_nᵀ``,
  and the score ``q̃ᵀ (F̃ + λ I)^{-1} g̃``.
* **Kronecker layers, EK-FAC**: the eigenbases ``Q_A``, ``Q_G`` stay those of the *uncorrected*
  K-FAC factors ``A``, ``G`` (they come from activations and output gradients, which the
  per-coordinate correction does not factor through); the eigenvalues are fit on the corrected
  per-sample gradients, ``Λ = (1/N) Σ_n (Q_Gᵀ G̃_n Q_A)²`` (``G̃_n = D ⊙ M_n`` in matrix form),
  and the score is ``q̃ᵀ ((Q_G ⊗ Q_A) diag(Λ) (Q_G ⊗ Q_A)ᵀ + λ I)^{-1} g̃``.
* **Kronecker layers, K-FAC**: refused. Its Fisher ``G ⊗ A`` is the product of the uncorrected
  factors and cannot reflect the correction; use :class:`EKFACAttributor` (corrected
  eigenvalues) or :class:`ProjectedFisherAttributor` (the exact corrected Fisher).
* **Diagonal layers** (``non_kronecker="diagonal"``): the diagonal Fisher of the corrected
  gradients, ``(1/N) Σ_n g̃_n²``.

On a vector layer the correction acts through the damping alone:
``q̃ᵀ (D F D + λ I)^{-1} g̃ = qᵀ (F + λ D^{-2})^{-1} g``, i.e. the uncorrected Fisher damped by
``λ diag(v + ε)`` instead of ``λ I``; where ``F`` is invertible and ``λ → 0`` it cancels, and it
matters as far as the damping does (``N < P``, heavy damping). EK-FAC's fixed Kronecker basis
is not adapted to ``D``, so there it also changes the curvature.

Relative damping is a factor of the corrected fit's mean eigenvalue; ``normalized_grad=True``
is the cosine after preconditioning of the corrected gradients,
``q̃ᵀ P g̃ / (√(g̃ᵀ P g̃) √(q̃ᵀ P q̃))``.

Fit and scores use the same correction: one :class:`SecondMoment` for every checkpoint, or one
per checkpoint (a list indexed by checkpoint label or ``{checkpoint: SecondMoment}``), each
checkpoint's fit and scores corrected by its own. A fit records the correction's fingerprint
(``KroneckerFactors.correction``, saved with the fit) and an attributor refuses a fit whose
fingerprint is not its own (a corrected fit without ``second_moment``, a raw fit with it, or
another ``v``). The correction is per coordinate, hence exact only on raw gradients or a
``"mask"`` projection; a store captured with ``"dense"`` / ``"sparse"`` / ``"logra"`` is refused
(the correction must precede a mixing projection). With ``mix > 0`` (K-FAC / EK-FAC) the query
gradients are corrected alike: every mixed mean of the fit is of corrected gradients but
``A`` and ``G``, so EK-FAC's basis is that of the mixed uncorrected factors. Not combined with
``covariances=`` for vector / diagonal layers (their corrected Fisher needs the training
gradients; refused). :meth:`KFACAttributor.preconditioner` returns ``D P D``, exact against
uncorrected train vectors (``q̃ᵀ P g̃ = (D P D q)ᵀ g``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from dattri_llm.attribution.kronecker.preconditioner import FisherPreconditioner
from dattri_llm.attribution.normalization import (
    SecondMoment,
    check_exact_coords,
    check_second_moment,
    moment_at,
)
from dattri_llm.gradient.gradient import Gradient, Materialized
from dattri_llm.gradient.kronecker import (
    KroneckerCovariances,
    KroneckerFactors,
    is_kronecker_layer,
)
from dattri_llm.gradient.layers import get_rule

__all__ = ["SecondMomentFisher", "MomentPreconditioner", "corrected_layers", "ViewedBlocks"]


def corrected_layers(moment: SecondMoment, gradient: Gradient, names: Iterable[str]) -> Gradient:
    """``gradient`` with the layers ``names`` multiplied by ``1/√(v + ε)``, the others kept."""
    names = [n for n in names if n in gradient.layers]
    if not names:
        return gradient
    fixed = moment.apply(gradient.select_layers(names)).layers
    return Gradient({n: fixed.get(n, lg) for n, lg in gradient.layers.items()})


@dataclass(frozen=True)
class MomentPreconditioner(FisherPreconditioner):
    """``D P D`` for a fit on corrected gradients: scores uncorrected train vectors exactly.

    ``q̃ᵀ P g̃ = (D P D q)ᵀ g`` with ``D = diag(1/√(v + ε))``, so an index over the raw (or
    ``"mask"``) store ranks as the corrected attributor does.

    Attributes:
        inner: The fit's own preconditioner ``P``.
        moment: The :class:`SecondMoment` of ``D``.
    """

    inner: Any = None
    moment: Any = None

    def precondition_gradient(self, gradient: Gradient) -> Gradient:
        """``D (P (D q))`` per fitted layer."""
        out = self.inner(corrected_layers(self.moment, gradient, self.layer_names))
        layers = {}
        for name, lg in out.layers.items():
            data = lg.materialize().data
            d = self.moment.scales(name, data.shape[1], data.device, data.dtype)
            layers[name] = Materialized(data * d, lg.layer_type, lg.module_kwargs)
        return Gradient(layers)

    __call__ = precondition_gradient


class ViewedBlocks:
    """A gradient source whose blocks are read through ``view(gradient, checkpoint)``.

    The fit's corrected gradients here; the vector view of ``ProjectedFisherAttributor``.
    """

    def __init__(self, source: Any, view: Callable[[Gradient, int], Gradient]) -> None:
        self.source, self.view = source, view
        self.rereadable = getattr(source, "rereadable", False)

    def __iter__(self) -> Iterator[Any]:
        for block in self.source:
            if isinstance(block, Gradient):
                yield self.view(block, 0)
            else:
                c = int(getattr(block, "checkpoint", 0))
                yield block._replace(gradient=self.view(block.gradient, c))


class SecondMomentFisher:
    """The ``second_moment=`` option of the Fisher attributors (see the module docstring).

    A base class of :class:`KFACAttributor`; its hooks are called from the fit, the scoring
    hooks and :meth:`preconditioner` there.
    """

    kind: ClassVar[str]
    non_kronecker: str
    second_moment: SecondMoment | dict[int, SecondMoment] | None = None

    def _init_second_moment(self, value: Any) -> None:
        self.second_moment = check_second_moment(value, f"{type(self).__name__}(second_moment=)")

    def _check_moment_granularity(self, granularity: Any) -> None:
        if granularity == "token" and self.second_moment is not None:
            raise ValueError(
                f"{type(self).__name__}(second_moment=...) scores the corrected gradients, which "
                "are materialized (no token axis): use attribution_granularity='sample'."
            )

    def _moment(self, checkpoint: int) -> SecondMoment | None:
        return moment_at(self.second_moment, checkpoint)

    def _moment_key(self) -> Any:
        """The correction as a fit's reuse key sees it (its fingerprint, per checkpoint)."""
        value = self.second_moment
        if isinstance(value, dict):
            return tuple(sorted((c, m.fingerprint()) for c, m in value.items()))
        return None if value is None else value.fingerprint()

    # ---- fit -------------------------------------------------------------------------------
    def _refuse_kfac(self, names: list[str]) -> None:
        raise ValueError(
            f"{type(self).__name__}(second_moment=...): K-FAC's Fisher G ⊗ A is the product of "
            "the uncorrected activation and output-gradient factors, so it cannot reflect the "
            f"per-coordinate correction 1/sqrt(v + eps) on the Kronecker layers {names}. Use "
            "EKFACAttributor(second_moment=...) (eigenvalues fit on the corrected gradients) or "
            "ProjectedFisherAttributor(second_moment=...) (the exact corrected Fisher)."
        )

    def _fit_gradient(self, gradient: Gradient, checkpoint: int, stage: str) -> Gradient:
        """The gradients a fit ``stage`` sees (a refusal for K-FAC on Kronecker layers).

        ``"covariances"`` corrects the vector (and diagonal) layers, K-FAC's factors stay raw;
        ``"eigenvalues"`` corrects the Kronecker layers.
        """
        moment = self._moment(checkpoint)
        if moment is None:
            return gradient
        names, kron = [], []
        for name, lg in gradient.layers.items():
            check_exact_coords(name, lg.layer_type)
            is_kron = is_kronecker_layer(lg)
            vector = is_kron and get_rule(lg.layer_type).exact_fisher
            if is_kron and not vector:
                kron.append(name)
                if stage == "eigenvalues":
                    names.append(name)
            elif stage == "covariances" and (vector or self.non_kronecker == "diagonal"):
                names.append(name)
        if kron and self.kind == "kfac":
            self._refuse_kfac(kron)
        return corrected_layers(moment, gradient, names)

    def _fit_blocks(self, source: Any, stage: str) -> Any:
        """``source``, each block corrected for the fit ``stage`` (see :meth:`_fit_gradient`)."""
        if self.second_moment is None or source is None:
            return source
        return ViewedBlocks(source, lambda g, c: self._fit_gradient(g, c, stage))

    def _check_moment_covariances(self, covs: dict[int, KroneckerCovariances]) -> None:
        """Refuse capture-time covariances where the correction needs the gradients."""
        if self.second_moment is None:
            return
        for cov in covs.values():
            vec = [n for n, c in cov.layers.items() if get_rule(c.layer_type).exact_fisher]
            if vec or cov.diagonal:
                raise ValueError(
                    f"{type(self).__name__}(second_moment=...): covariances accumulated during "
                    "capture are of the uncorrected gradients, and the corrected Fisher of the "
                    f"vector / diagonal layers {vec + list(cov.diagonal)} needs the training "
                    "gradients; fit from train_source without covariances=."
                )
            if self.kind == "kfac" and cov.layers:
                self._refuse_kfac(list(cov.layers))

    def _tag_fits(self, fits: dict[int, KroneckerFactors]) -> dict[int, KroneckerFactors]:
        """Record on each fresh fit the fingerprint of the correction it was made with."""
        for c, fit in fits.items():
            moment = self._moment(c)
            fit.correction = None if moment is None else moment.fingerprint()
        return fits

    # ---- scores ----------------------------------------------------------------------------
    def _check_fit_moment(self, fit: KroneckerFactors, checkpoint: int) -> KroneckerFactors:
        """``fit``, if it was made with this attributor's correction at ``checkpoint``."""
        moment = self._moment(checkpoint)
        want = None if moment is None else moment.fingerprint()
        if fit.correction == want:
            return fit
        if want is None:
            why = "was fit on gradients corrected by a SecondMoment, and this attributor has none"
        elif fit.correction is None:
            why = "was fit on uncorrected gradients, and this attributor corrects them"
        else:
            why = "was fit with another SecondMoment (another v or eps) than this attributor's"
        raise ValueError(
            f"{type(self).__name__}: the Kronecker fit for checkpoint {checkpoint} {why}; fit "
            "and scores must use the same correction. Pass the SecondMoment the fit was made "
            "with as second_moment=, or refit (fit(..., refit=True))."
        )

    def _score_view(self, gradient: Gradient, checkpoint: int, names: Iterable[str]) -> Gradient:
        """The gradients scored: the fitted layers ``names`` corrected (if a moment is given)."""
        moment = self._moment(checkpoint)
        return gradient if moment is None else corrected_layers(moment, gradient, names)

    def _moment_preconditioner(
        self, p: FisherPreconditioner, checkpoint: int
    ) -> FisherPreconditioner:
        """``p`` or, with a correction, ``D p D`` (:class:`MomentPreconditioner`)."""
        moment = self._moment(checkpoint)
        if moment is None:
            return p
        return MomentPreconditioner(
            p.factors, p.damping, p.relative, p.checkpoint, inner=p, moment=moment
        )
