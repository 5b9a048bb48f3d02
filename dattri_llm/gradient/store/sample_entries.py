"""Reading a version-2 partition's index: lazy entries over the binary rows, the journal's tail.

:func:`read_partition` opens a partition from its binary index
(:mod:`~dattri_llm.gradient.store.sample_index`) when the rows still describe the journal
(``index.jsonl``), and falls back to the journal line by line when it changed. Entries are
:class:`LazyEntry` objects made on demand by :class:`PartitionEntries`: the fields a row holds
come from the row; a record's journal line is parsed (and checked against its row) only when a
field only the line holds is asked for.
"""

from __future__ import annotations

import json
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dattri_llm.gradient.store.format import INDEX_FILE, StoreFormatError
from dattri_llm.gradient.store.index import (
    IndexEntry,
    _check_entry,
    check_sequence,
    decode_line,
    parse_index,
    shard_name,
)
from dattri_llm.gradient.store.sample_index import (
    FIELD,
    HAS_EXTRA,
    HAS_METADATA,
    REPAIR_HINT,
    SCHEMA_IN_LINE,
    BinaryIndex,
    schema_and_extras,
)

__all__ = ["LazyEntry", "PartitionEntries", "entry_column", "journal_crc", "read_partition"]


class _Journal:
    """Reads single lines of ``index.jsonl`` by offset (the file opened on demand)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def line(self, off: int, length: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(off)
            return f.read(length)


class LazyEntry(Mapping):
    """An index entry backed by a ``records.bin`` row; its journal line is parsed on demand."""

    __slots__ = ("_index", "_i", "_journal", "_line", "_hashes")
    _ROW_KEYS = ("seq", "step", "checkpoint", "n", "bytes", "crc32")

    def __init__(self, index: BinaryIndex, i: int, journal: _Journal) -> None:
        self._index = index
        self._i = i
        self._journal = journal
        self._line: dict | None = None
        self._hashes: list[str] | None = None

    def _row(self, name: str) -> int:
        return int(self._index.rows[self._i, FIELD[name]])

    def _parsed(self) -> dict:
        if self._line is None:
            off, length = self._row("line_off"), self._row("line_len")
            raw = self._journal.line(off, length)
            where = f"{self._journal.path}:seq {self._i} (byte {off})"
            try:
                entry = json.loads(raw) if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                entry = None
            if entry is None:
                raise StoreFormatError(
                    f"{where}: the line {self._index.records_path.name} points at is not a "
                    f"complete JSON line; the index is corrupted. {REPAIR_HINT}"
                )
            entry = _check_entry(entry, self._journal.path, self._i + 1)
            diff = [k for k in self._ROW_KEYS if entry[k] != self._row(k)]
            schema, extras = schema_and_extras(entry)
            if (schema, extras) != (self._row("schema"), self._row("extras")):
                diff.append("schema / metadata / extra")
            held = self._index.hashes(self._i)
            if held is not None and held != entry["hashes"]:
                diff.append("hashes")
            if diff:
                raise StoreFormatError(
                    f"{where} and {self._index.records_path} disagree on {', '.join(diff)}; the "
                    f"index is corrupted. {REPAIR_HINT}"
                )
            self._line = entry
        return self._line

    def _extras(self, key: str) -> bool | None:
        """Whether the line holds ``key`` when the row says so (``None``: parse the line)."""
        flags = self._row("extras")
        if key == "metadata":
            return bool(flags & HAS_METADATA)
        if key == "extra":
            return bool(flags & HAS_EXTRA)
        return None

    def __getitem__(self, key: str) -> Any:
        if key in self._ROW_KEYS:
            return self._row(key)
        if key == "schema" and self._line is None:
            flags = self._row("extras")
            if not flags & SCHEMA_IN_LINE:
                return self._row("schema").to_bytes(8, "little", signed=True).hex()
        if self._line is None and self._extras(key) is False:
            raise KeyError(key)  # the row says the line has no such field
        if key == "shard":
            return shard_name(self._i)
        if key == "hashes":
            if self._hashes is None:
                self._hashes = self._index.hashes(self._i)
            if self._hashes is not None:
                return self._hashes
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def get(self, key: str, default: Any = None) -> Any:
        """As ``dict.get`` (optional fields come from the journal line)."""
        if key in self._ROW_KEYS or key in ("shard", "hashes", "schema"):
            return self[key]
        if self._line is None and self._extras(key) is False:
            return default
        return self._parsed().get(key, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self._parsed()) == dict(other)

    __hash__ = None  # type: ignore[assignment]


class PartitionEntries(Sequence):
    """A version-2 partition's entries: lazy ones for the rows, then the journal's tail lines.

    An entry object is made only when it is asked for; :meth:`column` gives a field of every
    entry as an array without making any.
    """

    def __init__(self, index: BinaryIndex, journal: Path, tail: list[IndexEntry]) -> None:
        self.index = index
        self.tail = tail
        self._journal = _Journal(journal)

    def __len__(self) -> int:
        return self.index.num_records + len(self.tail)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        rows = self.index.num_records
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return LazyEntry(self.index, i, self._journal) if i < rows else self.tail[i - rows]

    def column(self, name: str) -> np.ndarray:
        """Field ``name`` (one of ``LazyEntry``'s row fields) of every entry, as int64."""
        tail = np.asarray([e[name] for e in self.tail], dtype=np.int64)
        return np.concatenate([np.asarray(self.index.column(name), dtype=np.int64), tail])


def entry_column(entries: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    """Field ``name`` of every entry as an int64 array (without entry objects where possible)."""
    if isinstance(entries, PartitionEntries):
        return entries.column(name)
    return np.asarray([e[name] for e in entries], dtype=np.int64)


def journal_crc(path: Path, end: int) -> int:
    """CRC-32 of the first ``end`` bytes of a file, read in chunks (no mapping kept)."""
    crc, left = 0, end
    buf = bytearray(1 << 22)
    with open(path, "rb", buffering=0) as f:
        while left:
            view = memoryview(buf)[: min(left, len(buf))]
            got = f.readinto(view)
            if not got:
                break
            crc = zlib.crc32(view[:got], crc)
            left -= got
    return crc


def read_partition(directory: Path, warn: bool = True) -> tuple[Sequence[IndexEntry], bool]:
    """A version-2 partition's entries: from its binary index where it matches the journal.

    The rows are used when the journal's bytes they cover have the CRC-32 the writer recorded;
    the journal's lines beyond them (a writer killed between its line and its row) are parsed.
    A journal changed under the rows (edited, truncated, rebuilt by an older version) is read
    line by line instead, with every check of a version-1 index, and a warning (the next writer
    or ``repair`` rebuilds the binary index).

    Returns:
        ``(entries, torn)``: the entries in ``seq`` order, and whether the journal ends in a
        torn line.

    Raises:
        StoreFormatError: a corrupted binary index (naming its file), or a corrupted journal.
    """
    index = BinaryIndex(directory, warn)
    journal = directory / INDEX_FILE
    size = journal.stat().st_size if journal.exists() else 0
    end = index.journal_end
    if end and (size < end or journal_crc(journal, end) != index.journal_crc):
        if warn:
            warnings.warn(
                f"{index.records_path} does not match {journal} (the journal changed after the "
                "binary index was written): reading the journal line by line. The next writer, "
                "or GradientStorageManager.repair(save_dir), rebuilds the binary index.",
                UserWarning,
                stacklevel=4,
            )
        found, _, torn = parse_index(journal, warn)
        check_sequence(found, journal)
        return found, torn
    torn, found = False, []
    if size > end:  # lines the rows do not cover yet
        with open(journal, "rb") as f:
            f.seek(end)
            data = f.read()
        found, torn = _parse_tail(journal, data, index.num_records, warn)
    entries = PartitionEntries(index, journal, found)
    if found:  # rare (a crash between line and row): the full sequence check
        check_sequence(list(entries), journal)
    return entries, torn


def _parse_tail(journal: Path, data: bytes, first: int, warn: bool) -> tuple[list[dict], bool]:
    stop = data.rfind(b"\n") + 1
    torn = stop < len(data)
    if torn and warn:
        warnings.warn(
            f"{journal}: ignoring a torn last index line ({len(data) - stop} bytes without a "
            "trailing newline), left by a writer that was killed while appending; that record "
            "is lost and a resuming writer truncates the line.",
            UserWarning,
            stacklevel=4,
        )
    out = []
    for k, line in enumerate(data[:stop].split(b"\n")[:-1]):
        lineno = first + k + 1
        out.append(_check_entry(decode_line(line, journal, lineno), journal, lineno))
    return out, torn
