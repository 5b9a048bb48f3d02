"""Which shards this process has already checked against their CRC-32, by file identity.

A store checks a shard's CRC-32 the first time it reads it (``verify=True``). Shards are
immutable once written (temp file, fsync, rename), so a shard whose file is the same file as
when it was checked -- same device, inode, size and modification time -- and whose index line
expects the same CRC-32 need not be read twice for the checksum. The registry is process-wide,
so a second ``attribute_from_cache`` (which opens a new ``GradientStorageManager``) does not
re-checksum the store: at 1M samples x 2048 float32 numbers that is ~2 CPU-s of zlib per call.

A file replaced by another (a rename, a repair) has another inode or modification time and is
checked again; so is a shard whose index line now expects another CRC-32.
``GradientStorageManager.verify_all`` forgets everything first and checks every shard.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["VerifiedShards", "identity"]

_SEEN: dict[str, tuple[int, ...]] = {}
_LOCK = threading.Lock()


Identity = tuple[int, int, int, int, int]


def identity(path: Path, crc32: int, st: os.stat_result | None = None) -> Identity | None:
    """The file's identity and the CRC-32 its index line expects (``None``: no such file).

    Take it *before* reading the file for the check, so that a file replaced meanwhile is
    recorded under its old identity and checked again.
    """
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, int(crc32))


class VerifiedShards:
    """A store's view of the process-wide registry of CRC-checked shard files."""

    def seen(self, path: Path, ident: Identity | None) -> bool:
        """Whether ``path`` was checked and is still the same file expecting the same CRC."""
        if ident is None:
            return False
        with _LOCK:
            return _SEEN.get(os.fspath(path)) == ident

    def add(self, path: Path, ident: Identity | None) -> None:
        """Record that ``path`` (of identity ``ident``, taken before the read) matched."""
        if ident is not None:
            with _LOCK:
                _SEEN[os.fspath(path)] = ident

    def clear(self) -> None:
        """Forget every checked shard (the next read of each is checked again)."""
        with _LOCK:
            _SEEN.clear()
