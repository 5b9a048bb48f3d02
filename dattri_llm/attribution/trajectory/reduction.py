"""The training loss's reduction of a captured run (``loss_reduction``), from three places.

A trajectory method needs to know whether the captured loop trained on the *sum* or the *mean*
of its per-sample losses (it sets the batch curvature's ``κ`` and how a removal re-normalises
the batch). It is taken from, in order:

1. the attributor's ``loss_reduction=`` argument;
2. what the capture recorded in the train records' metadata under
   :data:`~dattri_llm.gradient.callbacks.offload.LOSS_REDUCTION_KEY`
   (``OffloadCallback(loss_reduction="mean")``, or a user source's block metadata);
3. neither: a stored run is refused with an error naming both ways to declare it (a guess
   would change every score silently); the live path, which trains with the task's
   per-sample sum itself, uses ``"sum"``.

An argument that contradicts the recording is an error naming both; so are records that
disagree with each other.
"""

from __future__ import annotations

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
        ValueError: ``declared`` contradicts ``recorded``, or a stored run (not ``live``)
            declares it nowhere.
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
    if live:
        return "sum"  # the live path trains with the task's per-sample sum itself
    raise ValueError(
        f"{name}.{where}: loss_reduction is declared nowhere: neither the attributor's "
        "argument nor the train records say whether the captured run trained on the SUM or "
        "the MEAN of its per-sample losses, and the two give different scores. Declare it "
        f'either on the attributor, {name}(..., loss_reduction="mean") (or "sum"), or once '
        'at capture, OffloadCallback(..., loss_reduction="mean") (or "sum"), which records '
        "it in the store. A loop on model(**batch).loss (reduction='mean') trained on the "
        "mean."
    )


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
