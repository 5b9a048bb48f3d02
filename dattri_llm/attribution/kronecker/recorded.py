"""A K-FAC covariance pass over a store that recorded its Kronecker statistics at capture.

A compact store (``OffloadCallback`` defaults) writes a layer densely where that is smaller and
records, beside the records, the K-FAC sums of its factors
(:mod:`dattri_llm.gradient.store.kronecker_stats`). The covariance pass of a fit over such a
store then reads only what the sums do not hold:

* the records the sums do not cover (written without them), every layer, as before;
* of the covered records, only the layers outside the sums: vector layers (their exact Fisher
  is read from the stored vectors) and, with ``non_kronecker="diagonal"``, the non-Kronecker
  layers (their diagonal Fisher); with ``"skip"`` those are only named.

The sums hold every rank's records. Under ``torch.distributed`` (each rank passing over its
share, the accumulators all-reduced afterwards) rank 0 adds them and the other ranks add the
same layers with zero sums, so the all-reduce counts them once and every rank holds the same
layer set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dattri_llm.attribution.engine.units import RecordSource, units_of
from dattri_llm.gradient.kronecker import KroneckerCovariances
from dattri_llm.gradient.store.kronecker_stats import STATISTICS_TOKENS
from dattri_llm.utils.distributed import get_rank, get_world_size

__all__ = ["RecordedPass", "recorded_pass"]


@dataclass
class RecordedPass:
    """The recorded sums of a store and the blocks a covariance pass still has to read.

    Attributes:
        statistics: ``{checkpoint: KroneckerCovariances}``, the recorded sums.
        blocks: The blocks to read (see the module docstring).
    """

    statistics: dict[int, KroneckerCovariances]
    blocks: Iterable[Any]

    def add_to(self, covs: dict[int, KroneckerCovariances], non_kronecker: str) -> None:
        """Merge the recorded sums into the pass's accumulators (``covs``, by checkpoint).

        With ``non_kronecker="diagonal"`` the recorded names of the skipped layers are dropped:
        the pass gave them their diagonal Fisher.
        """
        lead = get_rank() == 0 or get_world_size() == 1
        for c, stats in sorted(self.statistics.items()):
            cov = covs.get(c)
            if cov is None:
                cov = covs[c] = KroneckerCovariances(non_kronecker, stats.tokens)
            part = KroneckerCovariances(non_kronecker, stats.tokens).merge(stats)
            if non_kronecker == "diagonal":
                part.skipped = {}
            if not lead:  # counted once: on rank 0
                for layer in part.layers.values():
                    layer.a_sum.zero_()
                    layer.g_sum.zero_()
                    layer.num_tokens = layer.num_samples = 0.0
                    if layer.block_tokens is not None:
                        layer.block_tokens.zero_()
            cov.merge(part)


def recorded_pass(source: Any, non_kronecker: str, tokens: str) -> RecordedPass | None:
    """The pass over a store with recorded statistics; ``None`` for any other source.

    Also ``None`` when the fit counts tokens otherwise than the recorded sums
    (``tokens="all"``): the pass then reads every record's factors.
    """
    if tokens != STATISTICS_TOKENS:
        return None
    units = units_of(source)
    read = getattr(getattr(units, "store", None), "kronecker_statistics", None)
    if units is None or not callable(read):
        return None
    stats = read(units.layers, units.all_checkpoints or None)
    if not stats.covered:
        return None
    rest = [u for u in units.units if u.index not in stats.covered]
    covered = [u for u in units.units if u.index in stats.covered]
    parts = [units.subset(rest)] if rest else []
    by_ckpt: dict[int, list] = {}
    for u in covered:
        by_ckpt.setdefault(u.checkpoint, []).append(u)
    for c, mine in sorted(by_ckpt.items()):
        held = stats.covariances.get(c)
        known = set() if held is None else set(held.layers)
        if held is not None and non_kronecker == "skip":
            known |= set(held.skipped)
        others = [n for n in units.layer_names if n not in known]
        if others:
            parts.append(RecordSource(units.store, mine, others, units.device, units.dtype))
    return RecordedPass(stats.covariances, _Chain(parts))


class _Chain:
    """The blocks of several sources, one after the other (re-readable)."""

    rereadable = True

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def __iter__(self) -> Iterator[Any]:
        for part in self.parts:
            yield from part
