"""``GradientSource``: what attributors read — blocks of ``(step, Gradient, hashes)``.

A source is an iterable of :class:`GradientBlock` in a stable order, plus ``rereadable``
(whether it can be iterated again, e.g. a store on disk, as opposed to a live stream that
recomputes). Attributors never care where blocks come from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple, Protocol, runtime_checkable

from dattri_llm.gradient.gradient import Gradient, GradientRecord

__all__ = ["GradientBlock", "GradientSource", "InMemoryGradientSource"]


class GradientBlock(NamedTuple):
    """One block of per-sample gradients.

    Attributes:
        step: Step index of the block (record step on disk, checkpoint index when live).
        gradient: Per-sample gradients of the block's samples.
        hashes: One sample identity per row of ``gradient``.
        checkpoint: Model state the block was captured at (pairs train and test blocks).
    """

    step: int
    gradient: Gradient
    hashes: list[str]
    checkpoint: int = 0


@runtime_checkable
class GradientSource(Protocol):
    """The contract every gradient source satisfies."""

    #: Whether iterating again yields the same blocks without recomputation.
    rereadable: bool

    def __iter__(self) -> Iterator[GradientBlock]:
        """Yield blocks in a stable order."""
        ...


class InMemoryGradientSource:
    """A source over records already in memory (e.g. from a ``CaptureCallback``)."""

    rereadable = True

    def __init__(self, records: Iterable[GradientRecord | GradientBlock]) -> None:
        self._blocks: list[GradientBlock] = []
        for r in records:
            if isinstance(r, GradientRecord):
                self._blocks.append(GradientBlock(r.step, r.gradient, list(r.hashes),
                                                  r.checkpoint))
            else:
                self._blocks.append(r)

    def __iter__(self) -> Iterator[GradientBlock]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
