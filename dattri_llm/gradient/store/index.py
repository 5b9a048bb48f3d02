"""The JSONL record index of one store partition: reading (with torn-line handling) and appends.

Each line is one JSON object describing one durable record (see ``docs/STORE_FORMAT.md``). A
line is appended only after its shard was written, fsynced and renamed, so a line never points
at a partial shard. A process killed while appending leaves a last line without its trailing
newline: readers ignore it with a warning and writers truncate it before appending.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dattri_llm.gradient.store.format import StoreFormatError, header_fingerprint

__all__ = [
    "IndexEntry",
    "read_index",
    "parse_index",
    "parse_lines",
    "decode_line",
    "check_entry",
    "check_sequence",
    "shard_name",
    "entry_for",
    "IndexAppender",
    "REQUIRED_FIELDS",
    "OPTIONAL_FIELDS",
]

#: Field name -> accepted Python type(s) of an index line.
REQUIRED_FIELDS: dict[str, type | tuple[type, ...]] = {
    "seq": int,
    "step": int,
    "checkpoint": int,
    "shard": str,
    "n": int,
    "hashes": list,
    "bytes": int,
    "crc32": int,
    "schema": str,
}

#: Optional fields of an index line and their types (also held by the shard header).
OPTIONAL_FIELDS: dict[str, type] = {"metadata": dict, "extra": dict}
#: Integer fields that cannot be negative.
_NON_NEGATIVE = ("seq", "n", "bytes", "crc32")

IndexEntry = dict[str, Any]


def shard_name(seq: int) -> str:
    """The shard path (relative to its partition) of the record with sequence number ``seq``."""
    return f"shards/{seq:09d}.safetensors"


def entry_for(seq: int, header: dict, size: int, crc: int) -> IndexEntry:
    """The index line of the shard ``seq`` whose header is ``header`` (size and CRC-32 given)."""
    entry: IndexEntry = {
        "seq": seq,
        "step": header["step"],
        "checkpoint": header["checkpoint"],
        "shard": shard_name(seq),
        "n": len(header["hashes"]),
        "hashes": header["hashes"],
        "bytes": size,
        "crc32": crc,
        "schema": header_fingerprint(header),
    }
    for key in OPTIONAL_FIELDS:
        if key in header:
            entry[key] = header[key]
    return entry


def decode_line(line: bytes, path: Path, lineno: int) -> Any:
    """One index line's JSON value (not yet checked as an entry).

    Raises:
        StoreFormatError: naming ``path:lineno`` when the line is not valid UTF-8 JSON.
    """
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreFormatError(f"{path}:{lineno}: index line is not valid JSON ({e}).") from None


def check_entry(entry: Any, path: Path, lineno: int) -> IndexEntry:
    """One decoded index line checked as an entry (fields, types, sizes, its shard name).

    Raises:
        StoreFormatError: naming ``path:lineno`` and what is wrong.
    """

    def bad(what: str) -> StoreFormatError:
        return StoreFormatError(f"{path}:{lineno}: {what}; the index is corrupted.")

    if not isinstance(entry, dict):
        raise bad("index line is not a JSON object")
    for key, typ in REQUIRED_FIELDS.items():
        value = entry.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise bad(f"index line has no valid {key!r} (got {value!r})")
    for key in _NON_NEGATIVE:
        if entry[key] < 0:
            raise bad(f"{key!r} is negative ({entry[key]})")
    if entry["crc32"] >= 2**32:
        raise bad(f"'crc32' {entry['crc32']} is not a CRC-32")
    for key, typ in OPTIONAL_FIELDS.items():
        if key in entry and not isinstance(entry[key], typ):
            raise bad(f"{key!r} is not a JSON object (got {entry[key]!r})")
    bad_hashes = [h for h in entry["hashes"] if not isinstance(h, str)]
    if bad_hashes:
        raise bad(f"'hashes' holds non-string items ({bad_hashes[0]!r})")
    if len(entry["hashes"]) != entry["n"]:
        raise bad(f"index line lists {len(entry['hashes'])} hashes for n={entry['n']}")
    shard = entry["shard"]
    if shard != shard_name(entry["seq"]):  # so it cannot point outside the partition either
        raise bad(
            f"shard {shard!r} is not the file of seq {entry['seq']} ({shard_name(entry['seq'])})"
        )
    return entry


def check_sequence(entries: list[IndexEntry], path: Path) -> None:
    """Check that line ``i`` of an index holds record ``seq == i`` (writers append in order).

    A repeated ``seq`` is a duplicated line (the record would be counted twice); a skipped one
    is a lost line (the record would be silently dropped).

    Raises:
        StoreFormatError: naming the index file, the line and what is wrong.
    """
    first_line: dict[int, int] = {}
    for i, entry in enumerate(entries):
        seq = entry["seq"]
        if seq in first_line:
            raise StoreFormatError(
                f"{path}:{i + 1}: duplicated index line: seq {seq} ({entry['shard']}) is already "
                f"listed on line {first_line[seq] + 1}, so the record would be counted twice. "
                "Remove the duplicate line, or run GradientStorageManager.repair(save_dir) to "
                "rebuild the index from the shards."
            )
        first_line[seq] = i
        if seq != i:
            what = (
                f"records seq {i}..{seq - 1} are missing before it (a line was lost)"
                if seq > i
                else "the lines are out of order"
            )
            raise StoreFormatError(
                f"{path}:{i + 1}: expected the record with seq {i}, found seq {seq}: {what}. "
                "Run GradientStorageManager.repair(save_dir) to rebuild the index from the "
                "shards, which carry their own headers."
            )


def read_index(path: Path, warn: bool = True) -> tuple[list[IndexEntry], int]:
    """Parse and check an index file (every line valid, ``seq`` = line number).

    Returns:
        ``(entries, valid_bytes)``: the complete lines' entries and the byte length of the
        complete lines (a writer truncates the file to it).

    Raises:
        StoreFormatError: naming the file and line of a complete line that is not a valid
            entry, or of a duplicated or missing record (see :func:`check_sequence`).
    """
    entries, end, _ = parse_index(path, warn)
    check_sequence(entries, path)
    return entries, end


def parse_index(
    path: Path,
    warn: bool = True,
    check: Callable[[Any, Path, int], IndexEntry] | None = None,
) -> tuple[list[IndexEntry], int, bool]:
    """Parse an index file without the sequence check.

    Args:
        path: The JSONL file.
        warn: Warn about a torn last line.
        check: ``check(entry, path, lineno) -> entry`` validating each line (default: a
            gradient-store index line); it raises ``StoreFormatError`` naming the line.

    Returns:
        ``(entries, valid_bytes, torn)``; ``torn``: the file ends in an incomplete line.
    """
    if not path.exists():
        return [], 0, False
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and warn:
        warnings.warn(
            f"{path}: ignoring a torn last index line ({len(data) - end} bytes without a "
            "trailing newline), left by a writer that was killed while appending; that record "
            "is lost and a resuming writer truncates the line.",
            UserWarning,
            stacklevel=3,
        )
    entries = []
    for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            raise StoreFormatError(f"{path}:{lineno}: empty index line; the index is corrupted.")
        entries.append((check or check_entry)(decode_line(line, path, lineno), path, lineno))
    return entries, end, end < len(data)


def parse_lines(path: Path) -> tuple[list[IndexEntry], int]:
    """Leniently read an index for repair: the lines that name a shard, its size and CRC-32.

    Returns:
        ``(entries, bad)``: those lines' objects (unchecked otherwise), and the number of other
        lines (unreadable, torn, or without those fields).
    """
    if not path.exists():
        return [], 0
    entries, bad = [], 0
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            bad += 1
            continue
        ok = isinstance(entry, dict) and isinstance(entry.get("shard"), str)
        if ok and all(
            isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool)
            for k in ("bytes", "crc32")
        ):
            entries.append(entry)
        else:
            bad += 1
    return entries, bad


class IndexAppender:
    """Append-only writer of one index file (truncates a torn tail first).

    Args:
        path: The ``index.jsonl`` file.
        valid_bytes: Length of its complete lines (from :func:`read_index`).
        fsync: fsync after every line (durability); off only for benchmarks / scratch stores.
    """

    def __init__(self, path: Path, valid_bytes: int, fsync: bool = True) -> None:
        self.path = path
        self.fsync = fsync
        if path.exists() and path.stat().st_size != valid_bytes:
            os.truncate(path, valid_bytes)
        self._file = open(path, "ab")  # noqa: SIM115 - closed in close()
        self._pos = valid_bytes

    def append(self, entry: IndexEntry) -> tuple[int, bytes]:
        """Write one entry as a line and make it durable; return ``(its offset, the line)``."""
        line = json.dumps(entry, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        self._file.write(line)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        off, self._pos = self._pos, self._pos + len(line)
        return off, line

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()
