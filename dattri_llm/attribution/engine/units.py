"""The train side as *units*: blocks known (rows, identities) before any gradient is read.

A gradient store's index tells every record's rows, sample identities, step and checkpoint
without loading a tensor. The score loop uses that to count each sample's rows in advance
(exact top-k streaming), to show a progress bar over samples with an ETA, to skip the records a
checkpoint already covers (resuming), and to split the records across ranks
(:mod:`dattri_llm.attribution.engine.distributed`).

:class:`RecordSource` is a :class:`~dattri_llm.gradient.sources.GradientSource` over a chosen
list of a store's records (and optionally chosen rows of each), in that order. A source is a
store's when it answers ``store_reading()`` (:func:`~dattri_llm.gradient.sources.store_reading`);
the store is read only through its public :class:`~dattri_llm.gradient.sources.RecordStore`
methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dattri_llm.gradient.gradient import GradientBlock
from dattri_llm.gradient.sources import RecordStore, store_reading

__all__ = ["Unit", "RecordSource", "units_of", "row_counts", "unit_digest"]


@dataclass
class Unit:
    """One record of a store (or the chosen rows of it).

    Attributes:
        index: The record's position in store order (``store.records()``).
        hashes: Its rows' sample identities (only the chosen rows).
        step: The record's step; checkpoint: its checkpoint label.
        rows: The chosen rows of the record (``None``: all of them).
    """

    index: int
    hashes: list[str]
    step: int
    checkpoint: int
    rows: list[int] | None = None
    nbytes: int = 0

    @property
    def num_rows(self) -> int:
        """Rows this unit contributes."""
        return len(self.hashes)


@dataclass
class RecordSource:
    """A re-readable source over chosen records of a store (see the module docstring).

    Attributes:
        store: The store (a ``GradientStorageManager``).
        units: The records (and rows) to yield, in order.
        layers: Read only these layers (``None``: all); device / dtype: where and how.
        all_checkpoints: Every checkpoint label of the full train side (a rank's share may
            miss some).
    """

    store: RecordStore
    units: list[Unit]
    layers: list[str] | None = None
    device: Any = "cpu"
    dtype: torch.dtype | None = None
    all_checkpoints: list[int] = field(default_factory=list)

    rereadable = True
    yields_blocks = True

    def __len__(self) -> int:
        return len(self.units)

    @property
    def num_samples(self) -> int:
        """Rows over all units."""
        return sum(u.num_rows for u in self.units)

    def load(self, unit: Unit) -> GradientBlock:
        """Read one unit from the store."""
        rec = self.store.load_record(
            unit.index, layers=self.layers, device=self.device, dtype=self.dtype
        )
        grad, hashes = rec.gradient, list(rec.hashes)
        if unit.rows is not None:
            grad = grad.slice(unit.rows)
            hashes = [hashes[i] for i in unit.rows]
        return GradientBlock(rec.step, grad, hashes, rec.checkpoint, rec.metadata)

    def __iter__(self) -> Iterator[GradientBlock]:
        for unit in self.units:
            yield self.load(unit)

    def capture_facts(self) -> Any:
        """What the store's gradients were captured as (see ``DiskGradientSource``)."""
        return self.store.capture_facts(self.layers)

    @property
    def layer_names(self) -> list[str]:
        """Names of the layers the blocks hold."""
        return list(self.layers) if self.layers is not None else self.store.layer_names

    def subset(self, units: Sequence[Unit]) -> RecordSource:
        """The same store and options over other units."""
        return RecordSource(
            self.store, list(units), self.layers, self.device, self.dtype, self.all_checkpoints
        )


def units_of(source: Any) -> RecordSource | None:
    """A :class:`RecordSource` over a source that reads a store (or itself); else ``None``."""
    if isinstance(source, RecordSource):
        return source
    reading = store_reading(source)
    if reading is None:
        return None
    store = reading.store
    units = [
        Unit(i, list(rec.hashes), rec.step, rec.checkpoint, None, size)
        for i, (rec, size) in enumerate(zip(store.records(), store.record_sizes()))
        if reading.wants(rec.checkpoint)
    ]
    ckpts = sorted({u.checkpoint for u in units})
    return RecordSource(store, units, reading.layers, reading.device, reading.dtype, ckpts)


def row_counts(units: Sequence[Unit]) -> dict[str, int]:
    """``{train hash: rows}`` over the units."""
    counts: dict[str, int] = {}
    for u in units:
        for h in u.hashes:
            counts[h] = counts.get(h, 0) + 1
    return counts


def unit_digest(source: RecordSource) -> str:
    """A digest of the records a source covers (store, record identities, rows, layers).

    The store's content fingerprint is part of it, so a store overwritten in place with other
    gradients of the same shapes gives another digest.
    """
    import hashlib
    import json
    import os

    records, sizes = source.store.records(), source.store.record_sizes()
    h = hashlib.sha256()
    h.update(os.path.realpath(source.store.save_dir).encode())
    h.update(json.dumps(source.layers).encode())
    h.update(json.dumps(source.store.fingerprint(), sort_keys=True).encode())
    for u in source.units:
        rec = records[u.index]
        key = [rec.rank, rec.seq, rec.step, rec.checkpoint, len(rec.hashes), sizes[u.index], u.rows]
        h.update(json.dumps(key).encode())
        h.update("\0".join(u.hashes).encode())
    return h.hexdigest()
