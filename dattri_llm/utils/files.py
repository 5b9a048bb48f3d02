"""Durable small-file writes (metadata, checkpoints, reports): atomic replace, directory fsync."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["atomic_write", "fsync_dir"]


def atomic_write(path: str | os.PathLike, data: bytes | str, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through a hidden temporary file beside it, then rename.

    A reader (or a process killed mid-write) sees the previous file or the new one, never a
    torn one. ``fsync=True`` also flushes the data to disk before the rename.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with open(tmp, "wb") as f:
        f.write(payload)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Fsync a directory (its entries: a rename is durable after this)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)
