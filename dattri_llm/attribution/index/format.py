"""The on-disk layout of a :class:`~dattri_llm.attribution.index.GradientIndex`, and store digests.

An index directory holds, and nothing in it is pickled:

* ``index.json`` -- versioned JSON metadata (:data:`INDEX_FORMAT_NAME`,
  :data:`INDEX_FORMAT_VERSION`): the store it was built from and that store's
  :func:`store_fingerprint`, the metric, the kind and its parameters, the layer order and
  dimensions, the capture fingerprint, and one entry per part (one per store partition);
* ``part_<i>.faiss`` -- part ``i``'s FAISS index, in FAISS's own format (``faiss.write_index``);
* ``part_<i>.samples.json`` -- part ``i``'s samples in FAISS id order: hashes, steps and
  checkpoints (``-1`` where a sample's rows span several);
* ``part_<i>.vectors.f32`` -- ``ivf`` with product quantization only (format version 2): the
  part's indexed vectors, raw float32 ``(n, D)`` in FAISS id order, from which a search
  re-ranks the PQ short list exactly (``part_search``; memory-mapped, never loaded whole).

``index.json`` is written last, so a directory without it is an interrupted build.

The store fingerprint is cheap and changes whenever the store does: per partition, the size
and SHA-256 of every top-level file (``meta.json`` and the record index; hidden files such as
the writer's lock are skipped), plus the record and row counts. A record index line carries its
shard's size and CRC-32, so an appended, removed, repaired-differently or overwritten record
changes it; shard files themselves are not read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "INDEX_FORMAT_NAME",
    "INDEX_FORMAT_VERSION",
    "META_NAME",
    "IndexFormatError",
    "StaleIndexError",
    "part_files",
    "rerank_file",
    "store_fingerprint",
    "fingerprint_difference",
    "write_json",
    "read_index_meta",
]

#: The format name written into ``index.json``.
INDEX_FORMAT_NAME = "dattri_llm.gradient_index"
#: The format version this code writes and the newest it reads (2: an ``ivf`` index with PQ
#: re-ranks from ``part_<i>.vectors.f32`` instead of an ``IndexRefineFlat`` inside the FAISS
#: file; version 1 indexes are still read).
INDEX_FORMAT_VERSION = 2
META_NAME = "index.json"


class IndexFormatError(ValueError):
    """An index directory is missing, damaged, or of an unsupported format."""


class StaleIndexError(ValueError):
    """The store an index was built from changed since the build."""


def part_files(directory: Path, i: int) -> tuple[Path, Path]:
    """``(part_<i>.faiss, part_<i>.samples.json)`` of part ``i``."""
    return directory / f"part_{i}.faiss", directory / f"part_{i}.samples.json"


def rerank_file(directory: Path, i: int) -> Path:
    """``part_<i>.vectors.f32``: part ``i``'s re-rank file (``ivf`` with PQ)."""
    return directory / f"part_{i}.vectors.f32"


def store_fingerprint(store: Any) -> dict[str, Any]:
    """A JSON digest of a store's indexes that changes whenever a record changes.

    Args:
        store: A ``GradientStorageManager``.

    Returns:
        ``{"records", "rows", "partitions": {relative dir: {file name: [size, sha256]}}}``
        (:meth:`~dattri_llm.GradientStorageManager.fingerprint`).
    """
    return store.fingerprint()


def fingerprint_difference(
    built: Mapping[str, Any], now: Mapping[str, Any], root: Path
) -> str | None:
    """What changed between two :func:`store_fingerprint` results (``None``: nothing)."""
    b_parts, n_parts = built.get("partitions", {}), now.get("partitions", {})
    for rel in sorted(set(b_parts) | set(n_parts)):
        where = root / rel
        if rel not in n_parts:
            return f"the partition {where} is gone"
        if rel not in b_parts:
            return f"a new partition {where} appeared"
        bf, nf = b_parts[rel], n_parts[rel]
        for name in sorted(set(bf) | set(nf)):
            if bf.get(name) != nf.get(name):
                what = "is new" if name not in bf else "is gone" if name not in nf else "changed"
                return f"{where / name} {what}"
    for key in ("records", "rows"):
        if built.get(key) != now.get(key):
            return f"the store holds {now.get(key)} {key}, the index covers {built.get(key)}"
    return None


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (a hidden temporary file, then a rename)."""
    from dattri_llm.utils.files import atomic_write

    atomic_write(path, json.dumps(obj, separators=(",", ":")), fsync=True)


def read_index_meta(directory: Path) -> dict[str, Any]:
    """Read and check ``index.json`` of an index directory.

    Raises:
        FileNotFoundError: the directory does not exist.
        IndexFormatError: no ``index.json`` (not an index, or an interrupted build), not
            JSON, another format, or a newer version than this code reads.
    """
    if not directory.is_dir():
        raise FileNotFoundError(
            f"index directory {directory} does not exist; build one with "
            "GradientIndex.build(train_store, index_dir) (or dattri-llm index build)."
        )
    path = directory / META_NAME
    if not path.is_file():
        raise IndexFormatError(
            f"{directory} is not a gradient index: it has no {META_NAME} (an interrupted build "
            "leaves none). Build it again with GradientIndex.build(train_store, index_dir)."
        )
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IndexFormatError(f"{path} is corrupted (not valid UTF-8 JSON): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT_NAME:
        raise IndexFormatError(
            f"{path} is not a dattri_llm gradient index (format "
            f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected "
            f"{INDEX_FORMAT_NAME!r})."
        )
    version = meta.get("version")
    if not isinstance(version, int) or not 1 <= version <= INDEX_FORMAT_VERSION:
        raise IndexFormatError(
            f"{path} has format version {version!r}; this dattri_llm reads versions 1.."
            f"{INDEX_FORMAT_VERSION}. Upgrade dattri_llm, or rebuild the index."
        )
    return meta
