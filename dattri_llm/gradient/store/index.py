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
from pathlib import Path
from typing import Any

from dattri_llm.gradient.store.format import StoreFormatError

__all__ = ["IndexEntry", "read_index", "IndexAppender", "REQUIRED_FIELDS"]

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

IndexEntry = dict[str, Any]


def _check_entry(entry: Any, path: Path, lineno: int) -> IndexEntry:
    if not isinstance(entry, dict):
        raise StoreFormatError(f"{path}:{lineno}: index line is not a JSON object.")
    for key, typ in REQUIRED_FIELDS.items():
        value = entry.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise StoreFormatError(
                f"{path}:{lineno}: index line has no valid {key!r} (got {value!r}); the index is "
                "corrupted."
            )
    if len(entry["hashes"]) != entry["n"]:
        raise StoreFormatError(
            f"{path}:{lineno}: index line lists {len(entry['hashes'])} hashes for n={entry['n']}."
        )
    shard = entry["shard"]
    if shard.startswith(("/", "\\")) or ".." in Path(shard).parts:
        raise StoreFormatError(f"{path}:{lineno}: shard path {shard!r} leaves the store.")
    return entry


def read_index(path: Path) -> tuple[list[IndexEntry], int]:
    """Parse an index file.

    Returns:
        ``(entries, valid_bytes)``: the complete lines' entries and the byte length of the
        complete lines (a writer truncates the file to it).

    Raises:
        StoreFormatError: naming the file and line of a complete line that is not a valid
            entry.
    """
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
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
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreFormatError(
                f"{path}:{lineno}: index line is not valid JSON ({e})."
            ) from None
        entries.append(_check_entry(entry, path, lineno))
    return entries, end


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

    def append(self, entry: IndexEntry) -> None:
        """Write one entry as a line and make it durable."""
        line = json.dumps(entry, separators=(",", ":"), allow_nan=False).encode() + b"\n"
        self._file.write(line)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (idempotent)."""
        if not self._file.closed:
            self._file.close()
