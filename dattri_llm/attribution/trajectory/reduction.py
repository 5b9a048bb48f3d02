"""The training loss's reduction of a captured run (``loss_reduction``), from three places.

A trajectory method needs to know whether the captured loop trained on the *sum* or the *mean*
of its per-sample losses (it sets the batch curvature's ``κ`` and how a removal re-normalises
the batch). It is taken from, in order:

1. the attributor's ``loss_reduction=`` argument;
2. what the capture recorded in the train records' metadata under
   :data:`~dattri_llm.gradient.callbacks.offload.LOSS_REDUCTION_KEY`
   (``OffloadCallback(loss_reduction="mean")``, or a user source's block metadata);
3. neither: ``"sum"`` with a warning naming both ways to declare it (the live path, which
   trains with the task's per-sample sum itself, uses ``"sum"`` without one).

An argument that contradicts the recording is an error naming both; so are records that
disagree with each other.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

from dattri_llm.gradient.callbacks.offload import LOSS_REDUCTION_KEY
from dattri_llm.gradient.gradient import GradientBlock

__all__ = ["REDUCTIONS", "recorded_reduction", "resolve_reduction", "checked_loads"]

REDUCTIONS = ("sum", "mean")


def recorded_reduction(blocks: Iterable[GradientBlock], where: str) -> str | None:
    """The reduction the blocks' metadata records (``None``: none records one).

    Raises:
        ValueError: two blocks record different reductions, or a value is not one of
            :data:`REDUCTIONS`.
    """
    found: dict[str, int] = {}
    for b in blocks:
        value = (b.metadata or {}).get(LOSS_REDUCTION_KEY)
        if value is None:
            continue
        if value not in REDUCTIONS:
            raise ValueError(
                f"{where}: the train record of step {b.step} records {LOSS_REDUCTION_KEY}="
                f"{value!r}; expected one of {REDUCTIONS}."
            )
        found.setdefault(value, b.step)
    if len(found) > 1:
        at = ", ".join(f"{v!r} (step {s})" for v, s in sorted(found.items()))
        raise ValueError(
            f"{where}: the train records disagree on how the training loss was reduced: {at}. "
            "One run has one reduction: score the records of each capture separately."
        )
    return next(iter(found), None)


def resolve_reduction(
    name: str, where: str, declared: str | None, recorded: str | None, live: bool
) -> str:
    """The reduction to score with (see the module docstring).

    Raises:
        ValueError: ``declared`` contradicts ``recorded``.
    """
    if declared is not None and recorded is not None and declared != recorded:
        raise ValueError(
            f"{name}.{where}: loss_reduction={declared!r} contradicts the train records, which "
            f"the capture recorded as loss_reduction={recorded!r} "
            f'(OffloadCallback(loss_reduction="{recorded}")). Pass the reduction the training '
            "loop used, or leave loss_reduction out to use the recorded one."
        )
    if declared is not None or recorded is not None:
        return declared or recorded  # type: ignore[return-value]
    if not live:
        warnings.warn(
            f"{name}.{where}: loss_reduction was not declared, so the scores assume the "
            "captured run trained on the SUM of the per-sample losses. If the loop trained "
            "on their mean (model(**batch).loss, reduction='mean'), every score is off: "
            f'declare {name}(..., loss_reduction="mean"), or record it once at capture with '
            'OffloadCallback(..., loss_reduction="mean"); declare loss_reduction="sum" to '
            "confirm the sum (and silence this warning).",
            UserWarning,
            stacklevel=5,
        )
    return "sum"


def checked_loads(
    load: Callable[[int], list[GradientBlock]], name: str, reduction: str
) -> Callable[[int], list[GradientBlock]]:
    """``load`` that refuses a step whose records record a reduction other than ``reduction``."""

    def checked(step: int) -> list[GradientBlock]:
        blocks = load(step)
        recorded = recorded_reduction(blocks, name)
        if recorded is not None and recorded != reduction:
            raise ValueError(
                f"{name}: the train records of step {step} record loss_reduction={recorded!r}, "
                f"the scores use {reduction!r} (declared, or recorded by earlier steps). One "
                "run has one reduction: score the records of each capture separately."
            )
        return blocks

    return checked
