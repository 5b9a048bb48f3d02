"""``FisherPreconditioner``: a fitted, damped ``(F̂ + λ I)^{-1}`` to apply to another query side.

Made by ``KFACAttributor.preconditioner`` (K-FAC, EK-FAC, or a projected vector layer's exact
Fisher) and folded into the query side of ``GradientIndex.search(preconditioner=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.kronecker import KroneckerFactors

__all__ = ["FisherPreconditioner", "DEFAULT_DAMPING", "resolve_damping"]

#: Default damping: this factor of each layer's mean eigenvalue (``relative=True``).
DEFAULT_DAMPING = 0.1


@dataclass(frozen=True)
class FisherPreconditioner:
    """A fitted, damped ``(F̂ + λ I)^{-1}`` (K-FAC, EK-FAC or a projected vector's exact Fisher).

    Made by :meth:`KFACAttributor.preconditioner`; called on a :class:`Gradient` it returns the
    preconditioned layers (what ``GradientIndex.search(preconditioner=...)`` folds in).

    Attributes:
        factors: The damping-free fit.
        damping: ``λ`` (absolute, or a factor of each layer's mean eigenvalue).
        relative: Whether ``damping`` is relative.
        checkpoint: The checkpoint label of the train gradients it was fitted on (``None``:
            not known). ``GradientIndex.search`` refuses it for an index over another label.
    """

    factors: KroneckerFactors
    damping: float
    relative: bool
    checkpoint: int | None = None

    @property
    def layer_names(self) -> list[str]:
        """The preconditioned layers (the others are left out of K-FAC scores)."""
        return self.factors.layer_names

    def precondition_gradient(self, gradient: Gradient) -> Gradient:
        """``(F̂ + λ I)^{-1} g`` per fitted layer (see ``KroneckerFactors.precondition``)."""
        return self.factors.precondition(gradient, self.damping, self.relative)

    __call__ = precondition_gradient


def resolve_damping(damping: float | None, relative: bool | None) -> tuple[float, bool]:
    """``(damping, relative)`` of a call; a number without ``relative`` is absolute."""
    if damping is not None:
        if isinstance(damping, bool) or not isinstance(damping, (int, float)) or damping < 0:
            raise ValueError(
                f"damping must be a number >= 0 (or None for the default, "
                f"{DEFAULT_DAMPING} x each layer's mean eigenvalue), got {damping!r}."
            )
        return float(damping), bool(relative)
    if relative is False:
        raise ValueError(
            "relative=False needs an absolute damping value, e.g. damping=1e-3 (damping=None "
            f"means the default, {DEFAULT_DAMPING} x each layer's mean eigenvalue)."
        )
    return DEFAULT_DAMPING, True
