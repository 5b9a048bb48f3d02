"""Finding a store's samples by identity: every ``(record, row)`` of a sample hash, in store order.

:class:`SampleLocator` is the object a :class:`~dattri_llm.GradientStorageManager` holds for one
store order (it builds a new one when the order changes); its :meth:`~SampleLocator.locations`
are what ``GradientStorageManager.locations`` / ``lookup`` / ``load_sample`` answer from.

No Python object per sample: a version-2 partition holds the 32-byte digest of every sample id
in its memory-mapped ``samples.bin`` (:mod:`~dattri_llm.gradient.store.binary_index`). The
locator is built, on the first lookup, from those files alone: for every sample row of a record
whose ids are digests, the first 8 bytes of its digest (a little-endian ``uint64`` key), its
record's position in store order and its row, sorted by the key with numpy, 20 bytes per row
(20 MB at 1M samples; the dict it replaces held a ``str`` and a list per id). A lookup is
a binary search for the key; each candidate is confirmed against the record's full id (two ids
sharing their first 16 hex digits are told apart, at the cost of decoding a record each).

Records the binary index does not cover fall back to a small dict of their ids: ids that are
not 64-digit lowercase hex digests, lines of the journal beyond the last binary row (a writer
killed between the two), records written by this process since the store was opened, and
every record of a version-1 partition (its JSONL index alone). Before it is used, the CRC-32
of every record's ids is checked (as decoding them one record at a time does), so a damaged
``samples.bin`` is an error naming the file, not a sample silently not found.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dattri_llm.gradient.store.binary_index import REPAIR_HINT, PartitionEntries
from dattri_llm.gradient.store.format import StoreFormatError

__all__ = ["SampleLocation", "SampleLocator"]


class SampleLocation(NamedTuple):
    """One occurrence of a sample: record ``record`` (store order), row ``row``."""

    record: int
    rank: int
    step: int
    checkpoint: int
    row: int
    path: Path


def _key(sample_hash: str) -> int | None:
    """The ``uint64`` key of a 64-digit lowercase hex id (``None``: not such an id)."""
    if len(sample_hash) != 64 or sample_hash != sample_hash.lower():
        return None
    try:
        return int.from_bytes(bytes.fromhex(sample_hash[:16]), "little")
    except ValueError:
        return None


def _check_ids(entries: PartitionEntries, flagged: np.ndarray) -> None:
    """The CRC-32 of the ids of every record whose ids ``samples.bin`` holds."""
    index = entries.index
    row0, n, crc = (index.column(c) for c in ("row0", "n", "ids_crc"))
    ids = index.ids
    for i in np.flatnonzero(flagged).tolist():
        lo = int(row0[i])
        if zlib.crc32(ids[lo : lo + int(n[i])]) != int(crc[i]):
            raise StoreFormatError(
                f"{index.samples_path} is corrupted: the ids of record seq {i} fail their "
                f"CRC-32. {REPAIR_HINT}"
            )


class SampleLocator:
    """``sample hash -> [(record, row), ...]`` in store order (see the module docstring).

    Args:
        sources: The manager's ``[(partition, entries)]`` (flat order: partition by
            partition), then ``extra``: its ``[(partition, entry)]`` written since opening.
        order: Store order: ``order[pos]`` is the flat index of the record at position
            ``pos``.
        ordered: ``[(partition, entry)]`` in store order (``ordered[pos]``: the record at
            position ``pos``; its ids confirm a candidate).
    """

    def __init__(
        self,
        sources: Sequence[tuple[Any, Sequence[Any]]],
        extra: Sequence[tuple[Any, Any]],
        order: Sequence[int],
        ordered: Sequence[tuple[Any, Any]],
    ) -> None:
        self._ordered = ordered
        #: The store order this locator was built for (a new order needs a new locator).
        self.order = order
        pos_of = np.empty(len(order), dtype=np.int64)
        pos_of[np.asarray(order, dtype=np.int64)] = np.arange(len(order), dtype=np.int64)
        keys, poss, rows = [], [], []
        self._other: dict[str, list[tuple[int, int]]] = {}
        loose: list[tuple[int, Any]] = []  # (flat index, entry) of the fallback records
        base = 0
        for _, src in sources:
            done = 0
            if isinstance(src, PartitionEntries) and src.index.num_records:
                index = src.index
                done = index.num_records
                n = index.column("n")
                flagged = index.column("ids").astype(bool)
                _check_ids(src, flagged)
                rec = np.repeat(np.arange(done, dtype=np.int64), n)
                keep = flagged[rec]
                total = int(rec.shape[0])
                key = np.ascontiguousarray(index.ids[:total, :8]).view("<u8")[:, 0]
                keys.append(key[keep])
                poss.append(pos_of[base + rec[keep]])
                within = np.arange(total, dtype=np.int64) - index.column("row0")[rec]
                rows.append(within[keep].astype(np.int32))
                loose += [(base + int(i), None) for i in np.flatnonzero(~flagged)]
            loose += [(base + i, None) for i in range(done, len(src))]
            base += len(src)
        loose += [(base + j, e) for j, (_, e) in enumerate(extra)]
        if keys:
            key, pos, row = np.concatenate(keys), np.concatenate(poss), np.concatenate(rows)
            perm = np.argsort(key)  # ties in any order: ``find`` sorts its few hits
            self._key, self._pos, self._row = key[perm], pos[perm], row[perm]
        else:
            self._key = np.zeros(0, np.uint64)
            self._pos = np.zeros(0, np.int64)
            self._row = np.zeros(0, np.int32)
        for flat, _ in loose:
            pos = int(pos_of[flat])
            for r, h in enumerate(self._hashes_of(pos)):
                self._other.setdefault(h, []).append((pos, r))

    @property
    def nbytes(self) -> int:
        """Bytes of the sorted arrays (the fallback dict aside)."""
        return int(self._key.nbytes + self._pos.nbytes + self._row.nbytes)

    def find(self, sample_hash: str) -> list[tuple[int, int]]:
        """Every ``(record position, row)`` of ``sample_hash``, in store order."""
        out = list(self._other.get(sample_hash, ()))
        key = _key(sample_hash)
        if key is not None and self._key.size:
            k = np.uint64(key)
            lo = int(np.searchsorted(self._key, k, "left"))
            hi = int(np.searchsorted(self._key, k, "right"))
            for pos, row in zip(self._pos[lo:hi].tolist(), self._row[lo:hi].tolist()):
                if self._hashes_of(pos)[row] == sample_hash:
                    out.append((pos, row))
        return sorted(out) if len(out) > 1 else out

    def _hashes_of(self, pos: int) -> Sequence[str]:
        return self._ordered[pos][1]["hashes"]

    def locations(self, sample_hash: str) -> list[SampleLocation]:
        """Every occurrence of ``sample_hash`` (record, step, row, shard), in store order."""
        out = []
        for pos, row in self.find(sample_hash):
            part, e = self._ordered[pos]
            out.append(
                SampleLocation(
                    pos, part.rank, e["step"], e["checkpoint"], row, part.directory / e["shard"]
                )
            )
        return out
