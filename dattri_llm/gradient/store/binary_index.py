"""The binary, memory-mapped record and sample index of a partition (format version 2).

``index.jsonl`` stays the journal of a partition (one JSON line per record, appended and
fsynced first); beside it a version-2 partition keeps two fixed-width binary files, so that
opening a store reads no JSON and holds no Python object per sample:

* ``records.bin`` — a 16-byte header (``RECORDS_MAGIC``, the row width) and one row of
  :data:`FIELDS` (little-endian int64) per record: ``seq``, ``step``, ``checkpoint``, ``n``,
  ``row0`` (its first row in ``samples.bin``), the byte offset and length of its line in
  ``index.jsonl``, the shard's ``bytes`` and ``crc32``, ``ids`` (1: the sample ids are 64-digit
  hex digests held in ``samples.bin``; 0: other ids, read from the line), ``ids_crc`` (CRC-32 of
  its 32-byte ids) and ``check`` (a checksum of the other fields);
* ``samples.bin`` — a 16-byte header (``SAMPLES_MAGIC``) and 32 bytes per sample row: the
  SHA-256 digest of each sample id (zeros in a record whose ids are not hex digests).

Both are appended after the record's line is durable: samples first, then the record row (the
commit point), each fsynced. A killed writer leaves a torn row (ignored with a warning; the next
writer truncates it) or files one record behind the journal (the reader parses the journal's
lines beyond the last row; the next writer appends the missing rows). Opening checks every row
at once with numpy (sequence, offsets, checksum) and that ``index.jsonl`` and ``samples.bin``
are as long as the rows say; a record's line is parsed only when a field the rows do not hold
is asked for (schema, metadata, extra, non-digest ids), and is then checked against its row.
Any disagreement is a :class:`StoreFormatError` naming the file.

Reading: :func:`read_partition` opens a partition from its rows when they still describe the
journal, and falls back to the journal line by line when it changed. Entries are
:class:`LazyEntry` objects made on demand by :class:`PartitionEntries`: the fields a row holds
come from the row; a record's journal line is parsed (and checked against its row) only when a
field only the line holds is asked for.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dattri_llm.gradient.store.format import INDEX_FILE, StoreFormatError
from dattri_llm.gradient.store.index import (
    IndexEntry,
    check_entry,
    check_sequence,
    decode_line,
    parse_index,
    shard_name,
)

__all__ = [
    "RECORDS_FILE",
    "SAMPLES_FILE",
    "FIELDS",
    "FIELD",
    "BinaryIndex",
    "BinaryAppender",
    "line_spans",
    "write_binary_index",
    "uses_binary_index",
    "schema_and_extras",
    "LazyEntry",
    "PartitionEntries",
    "entry_column",
    "journal_crc",
    "read_partition",
]

RECORDS_FILE = "records.bin"
SAMPLES_FILE = "samples.bin"
RECORDS_MAGIC = b"DTLREC02"
SAMPLES_MAGIC = b"DTLSMP02"
HEADER = 16
ID_BYTES = 32
#: The int64 fields of one ``records.bin`` row, in order.
FIELDS = (
    "seq",
    "step",
    "checkpoint",
    "n",
    "row0",
    "line_off",
    "line_len",
    "bytes",
    "crc32",
    "ids",
    "ids_crc",
    "journal_crc",
    "schema",
    "extras",
    "check",
)
WIDTH = 8 * len(FIELDS)
FIELD = {name: i for i, name in enumerate(FIELDS)}
_F = FIELD
#: Odd multipliers of the row checksum (one per field but ``check``).
_MIX = np.array(
    [(0x9E3779B97F4A7C15 + 2 * i * 0x632BE59BD9B4E019) % 2**64 for i in range(len(FIELDS) - 1)],
    dtype=np.uint64,
)
REPAIR_HINT = "GradientStorageManager.repair(save_dir) rebuilds it from the shards."


def _checksum(rows: np.ndarray) -> np.ndarray:
    """``(R,)`` int64 checksums of ``(R, len(FIELDS))`` int64 rows (their ``check`` ignored)."""
    with np.errstate(over="ignore"):
        mixed = rows[:, :-1].astype(np.uint64) * _MIX
        total = np.bitwise_xor.reduce(mixed, axis=1) + mixed.sum(axis=1, dtype=np.uint64)
    return total.view(np.int64)


def _digests(hashes: Sequence[str]) -> bytes | None:
    """The 32-byte digests of 64-digit lowercase hex ids (``None`` if any id is not one)."""
    try:
        raw = b"".join(bytes.fromhex(h) for h in hashes if len(h) == 64 and h == h.lower())
    except ValueError:
        return None
    return raw if len(raw) == ID_BYTES * len(hashes) else None


def _row(
    entry: Mapping[str, Any], row0: int, line_off: int, line_len: int, journal_crc: int
) -> tuple[list, bytes]:
    hashes = list(entry["hashes"])
    ids = _digests(hashes)
    blob = ids if ids is not None else bytes(ID_BYTES * len(hashes))
    fields = [
        entry["seq"],
        entry["step"],
        entry["checkpoint"],
        entry["n"],
        row0,
        line_off,
        line_len,
        entry["bytes"],
        entry["crc32"],
        int(ids is not None),
        zlib.crc32(blob),
        journal_crc,
        *schema_and_extras(entry),
        0,
    ]
    return fields, blob


#: ``extras`` bits: the line holds ``metadata`` / ``extra``; its schema is not a 16-hex digest.
HAS_METADATA, HAS_EXTRA, SCHEMA_IN_LINE = 1, 2, 4
_HEX16 = frozenset("0123456789abcdef")


def schema_and_extras(entry: Mapping[str, Any]) -> tuple[int, int]:
    """The ``schema`` and ``extras`` fields of an entry's row."""
    schema = entry["schema"]
    flags = HAS_METADATA * ("metadata" in entry) + HAS_EXTRA * ("extra" in entry)
    if len(schema) == 16 and set(schema) <= _HEX16:
        return int.from_bytes(bytes.fromhex(schema), "little", signed=True), flags
    return 0, flags | SCHEMA_IN_LINE


def _pack(rows: list[list[int]]) -> np.ndarray:
    arr = np.asarray(rows, dtype=np.int64).reshape(-1, len(FIELDS))
    arr[:, -1] = _checksum(arr)
    return arr


def uses_binary_index(meta: Mapping[str, Any]) -> bool:
    """Whether a partition (its ``meta.json``) keeps the binary index (format version >= 2)."""
    return int(meta.get("version", 1)) >= 2


def line_spans(data: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of every complete line (with its newline) of a JSONL file."""
    spans, pos = [], 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            return spans
        spans.append((pos, end + 1 - pos))
        pos = end + 1


# ---- writing ------------------------------------------------------------------------------------
def _write_file(path: Path, magic: bytes, payload: bytes, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(magic + WIDTH.to_bytes(8, "little") + payload)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_binary_index(
    directory: Path, entries: Sequence[Mapping[str, Any]], journal: bytes, fsync: bool = True
) -> None:
    """Write both files for ``entries`` (whose lines ``journal`` holds) atomically.

    Each file is written to a temp file, fsynced and renamed; ``samples.bin`` first, so a
    committed ``records.bin`` never points past the ids.
    """
    rows, blobs, row0, crc = [], [], 0, 0
    for entry, (off, length) in zip(entries, line_spans(journal)):
        crc = zlib.crc32(journal[off : off + length], crc)
        fields, blob = _row(entry, row0, off, length, crc)
        rows.append(fields)
        blobs.append(blob)
        row0 += int(entry["n"])
    _write_file(directory / SAMPLES_FILE, SAMPLES_MAGIC, b"".join(blobs), fsync)
    _write_file(directory / RECORDS_FILE, RECORDS_MAGIC, _pack(rows).tobytes(), fsync)


class BinaryAppender:
    """Appends one record at a time to a partition's binary index (after its journal line).

    Args:
        directory: The partition.
        index: The rows to keep (the files are cut to them: a torn row, uncommitted ids).
        journal_crc: CRC-32 of the journal up to the end of the last kept row's line.
        fsync: fsync after every record.
    """

    def __init__(
        self, directory: Path, index: BinaryIndex, journal_crc: int, fsync: bool = True
    ) -> None:
        self.fsync = fsync
        self._row0 = index.num_rows
        self._crc = journal_crc
        self._files = []
        for name, magic, keep in (
            (SAMPLES_FILE, SAMPLES_MAGIC, HEADER + ID_BYTES * index.num_rows),
            (RECORDS_FILE, RECORDS_MAGIC, HEADER + WIDTH * index.num_records),
        ):
            path = directory / name
            if not path.exists() or path.stat().st_size < HEADER:
                _write_file(path, magic, b"", fsync)
            elif path.stat().st_size != keep:
                os.truncate(path, keep)
            self._files.append(open(path, "ab"))  # noqa: SIM115 - closed in close()

    def append(self, entry: Mapping[str, Any], line_off: int, line: bytes) -> None:
        """Append one record whose journal line ``line`` is durable at ``line_off``."""
        self._crc = zlib.crc32(line, self._crc)
        fields, blob = _row(entry, self._row0, line_off, len(line), self._crc)
        samples, records = self._files
        for f, data in ((samples, blob), (records, _pack([fields]).tobytes())):
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        self._row0 += int(entry["n"])

    def close(self) -> None:
        """Close both files (idempotent)."""
        for f in self._files:
            if not f.closed:
                f.close()


# ---- reading ------------------------------------------------------------------------------------
class BinaryIndex:
    """The rows of a partition's ``records.bin`` and its ``samples.bin``, memory-mapped.

    Args:
        directory: The partition.
        warn: Warn about a torn last row.

    Raises:
        StoreFormatError: naming the file whose header, rows or length is wrong.
    """

    def __init__(self, directory: Path, warn: bool = True) -> None:
        self.directory = directory
        self.records_path = directory / RECORDS_FILE
        self.samples_path = directory / SAMPLES_FILE
        self.rows = np.zeros((0, len(FIELDS)), dtype=np.int64)
        self.ids = np.zeros((0, ID_BYTES), dtype=np.uint8)
        self.torn = False
        if self.records_path.exists():
            self._load(warn)

    def _bad(self, path: Path, what: str) -> StoreFormatError:
        return StoreFormatError(f"{path} is corrupted: {what}. {REPAIR_HINT}")

    def _load(self, warn: bool) -> None:
        path = self.records_path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER)
        if (
            size < HEADER
            or head[:8] != RECORDS_MAGIC
            or int.from_bytes(head[8:], "little") != WIDTH
        ):
            raise self._bad(path, f"not a records index (header {head!r})")
        count, tail = divmod(size - HEADER, WIDTH)
        if tail:
            self.torn = True
            if warn:
                warnings.warn(
                    f"{path}: ignoring a torn last row ({tail} bytes), left by a writer that "
                    "was killed while appending; the next writer truncates it.",
                    UserWarning,
                    stacklevel=4,
                )
        rows = (
            np.memmap(path, dtype="<i8", mode="r", offset=HEADER, shape=(count, len(FIELDS)))
            if count
            else np.zeros((0, len(FIELDS)), dtype=np.int64)
        )
        rows = np.asarray(rows)  # a plain view of the mapping (memmap indexing is slow)
        self._check_rows(rows)
        self.rows = rows
        need = int(rows[-1, _F["row0"]] + rows[-1, _F["n"]]) if count else 0
        spath = self.samples_path
        ssize = spath.stat().st_size if spath.exists() else 0
        if ssize < HEADER + ID_BYTES * need:
            raise self._bad(spath, f"{ssize} bytes, {path.name} lists {need} sample rows")
        with open(spath, "rb") as f:
            if f.read(8) != SAMPLES_MAGIC:
                raise self._bad(spath, "not a sample index (bad header)")
        if need:
            ids = np.memmap(spath, dtype=np.uint8, mode="r", offset=HEADER, shape=(need, 32))
            self.ids = np.asarray(ids)

    def _check_rows(self, rows: np.ndarray) -> None:
        if not len(rows):
            return
        path = self.records_path
        col = {name: rows[:, i] for name, i in _F.items()}
        checks = [
            (col["check"] == _checksum(np.asarray(rows)), "its checksum does not match"),
            (col["seq"] == np.arange(len(rows)), "its seq is not its row number"),
            ((col["n"] >= 0) & (col["bytes"] >= 0) & (col["line_len"] > 0), "a negative size"),
            ((col["crc32"] >= 0) & (col["crc32"] < 2**32), "'crc32' is not a CRC-32"),
            (np.isin(col["ids"], (0, 1)), "'ids' is neither 0 nor 1"),
            ((col["extras"] >= 0) & (col["extras"] < 8), "'extras' is not a flag set"),
        ]
        starts = np.concatenate([[0], np.cumsum(col["n"])[:-1]])
        checks.append((col["row0"] == starts, "its row0 does not follow the rows before it"))
        offs = np.concatenate([[0], np.cumsum(col["line_len"])[:-1]])
        checks.append((col["line_off"] == offs, f"its line offset in {INDEX_FILE} is wrong"))
        for ok, what in checks:
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                raise self._bad(path, f"row {bad} (record seq {bad}): {what}")

    @property
    def num_records(self) -> int:
        """Records (complete rows)."""
        return int(self.rows.shape[0])

    @property
    def num_rows(self) -> int:
        """Sample rows of those records."""
        if not self.num_records:
            return 0
        return int(self.rows[-1, _F["row0"]] + self.rows[-1, _F["n"]])

    @property
    def journal_end(self) -> int:
        """Bytes of ``index.jsonl`` the rows account for."""
        if not self.num_records:
            return 0
        return int(self.rows[-1, _F["line_off"]] + self.rows[-1, _F["line_len"]])

    @property
    def journal_crc(self) -> int:
        """CRC-32 of ``index.jsonl`` up to :attr:`journal_end`, as the writer recorded it."""
        return int(self.rows[-1, _F["journal_crc"]]) if self.num_records else 0

    def keep(self, count: int) -> None:
        """Forget the rows from ``count`` on (a writer rebuilds them)."""
        self.rows = self.rows[:count]

    def column(self, name: str) -> np.ndarray:
        """One field of every row."""
        return self.rows[:, _F[name]]

    def hashes(self, i: int) -> list[str] | None:
        """The ids of record ``i`` when held here (hex digests), else ``None``."""
        row = self.rows[i]
        if not row[_F["ids"]]:
            return None
        lo, n = int(row[_F["row0"]]), int(row[_F["n"]])
        blob = self.ids[lo : lo + n].tobytes()
        if zlib.crc32(blob) != int(row[_F["ids_crc"]]):
            raise self._bad(self.samples_path, f"the ids of record seq {i} fail their CRC-32")
        return [blob[j : j + ID_BYTES].hex() for j in range(0, len(blob), ID_BYTES)]


# ---- entries ------------------------------------------------------------------------------------
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
            entry = check_entry(entry, self._journal.path, self._i + 1)
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
        out.append(check_entry(decode_line(line, journal, lineno), journal, lineno))
    return out, torn
