"""Finding a store's partitions and checking that their indexes account for every shard.

A *partition* is a directory with ``meta.json``, ``index.jsonl`` and ``shards/``: the store
root (single process) or ``rank_N/`` under it (``torch.distributed``). These checks are what
make a store impossible to misread silently: a copied partition, a shard no index line points
at (a lost line, a truncated index), or the same record in two partitions is an error naming
the files; only the one record a killed writer can leave unindexed is ignored (with a warning).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from dattri_llm.gradient.store.format import INDEX_FILE, META_FILE, SHARD_DIR, StoreFormatError
from dattri_llm.gradient.store.format import read_meta as _read_meta
from dattri_llm.gradient.store.index import IndexEntry, shard_name

__all__ = [
    "Partition",
    "is_rank_dir",
    "discover_partitions",
    "shard_files",
    "check_unindexed",
    "check_duplicate_records",
]

_RANK_DIR = re.compile(r"rank_(0|[1-9][0-9]*)")
_ALL_SHARDS = re.compile(r"(?:shards/[0-9]{9}\.safetensors)*")
_REPAIR_HINT = (
    "Run GradientStorageManager.repair(save_dir) to rebuild the index from the shards (they "
    "carry their own headers)."
)


class Partition(NamedTuple):
    """One partition: its rank and directory."""

    rank: int
    directory: Path


def is_rank_dir(p: Path) -> bool:
    """Whether ``p`` is a partition directory ``rank_N`` (canonical N, no leading zeros)."""
    return p.is_dir() and _RANK_DIR.fullmatch(p.name) is not None


def _has_partition(d: Path) -> bool:
    return any((d / name).exists() for name in (INDEX_FILE, META_FILE, SHARD_DIR))


def discover_partitions(root: Path) -> list[Partition]:
    """The partitions under ``root`` (root first, then ``rank_N`` by rank), meta files checked.

    Raises:
        StoreFormatError: ``root`` holds files but no ``meta.json``; a ``meta.json`` is
            unreadable; the root partition's rank is not 0, or ``rank_N/meta.json`` names
            another rank (a partition copied under another rank's directory).
    """
    if not root.is_dir():
        return []
    entries = list(root.iterdir())
    subdirs = sorted((p for p in entries if is_rank_dir(p)), key=lambda p: int(p.name[5:]))
    if not (root / META_FILE).is_file():
        others = [p.name for p in entries if not is_rank_dir(p) and not p.name.startswith(".")]
        if others:
            raise StoreFormatError(
                f"{root} is not a gradient store: it has no {META_FILE} but holds "
                f"{sorted(others)[:5]}. Pass an empty or new directory, or a store's save_dir."
            )
    else:
        meta = _read_meta(root)
        if (root / INDEX_FILE).exists() or (root / SHARD_DIR).exists():
            if meta.get("rank", 0) != 0:
                raise StoreFormatError(
                    f"{root / META_FILE} gives the root partition rank {meta['rank']}; a "
                    "single-process store is rank 0 (the file is corrupted or was copied)."
                )
    parts = []
    if (root / INDEX_FILE).exists() or (root / SHARD_DIR).exists():
        parts.append(Partition(0, root))
    for d in subdirs:
        if not _has_partition(d):
            continue
        rank = int(d.name[5:])
        meta = _read_meta(d)
        if meta.get("rank", rank) != rank:
            raise StoreFormatError(
                f"{d / META_FILE} was written by rank {meta['rank']} but lies in {d.name}/: the "
                f"partition was copied or moved, and its records would be counted twice. Remove "
                f"{d} (or move it back to rank_{meta['rank']}/ if that one is missing)."
            )
        parts.append(Partition(rank, d))
    return parts


def shard_files(directory: Path) -> list[str]:
    """Shard files of a partition (``shards/*.safetensors``, hidden temp files excluded)."""
    shards = directory / SHARD_DIR
    if not shards.is_dir():
        return []
    return sorted(
        f"{SHARD_DIR}/{name}"
        for name in os.listdir(shards)
        if name.endswith(".safetensors") and not name.startswith(".")
    )


def check_unindexed(
    part: Partition, entries: Sequence[IndexEntry], torn: bool, *, live: bool = False
) -> list[str]:
    """Check that the index accounts for every shard of a partition.

    A killed writer can leave exactly one shard without its index line: the next one in
    sequence (it died between renaming the shard and appending the line, or inside the
    append). That record is ignored with a warning and removed by the next writer. Any other
    unindexed shard means index lines were lost. ``live``: the partition's writer may be
    running (another rank of this ``torch.distributed`` run), so that one shard is the record
    it is indexing now: ignored without a warning.

    Returns:
        The unindexed shard a killed writer left (``[]`` or one name).

    Raises:
        StoreFormatError: naming the index and the shards it does not account for.
    """
    # entries hold seq 0..len-1 in order (checked before), so shard i is listed iff i < count
    count = len(entries)
    files = shard_files(part.directory)  # sorted "shards/<name>.safetensors"
    if len(files) in (count, count + 1) and _ALL_SHARDS.fullmatch("".join(files)):
        # distinct sorted 9-digit names, the count-th of them shard count-1: exactly 0..count-1
        if count == 0 or files[count - 1] == shard_name(count - 1):
            orphans = files[count:]
        else:
            orphans = [f for f in files if int(f[7:16]) >= count]
    else:
        width = len(shard_name(0))
        orphans = [
            s
            for s in files
            if len(s) != width
            or not (s[7:16].isascii() and s[7:16].isdigit())
            or int(s[7:16]) >= count
        ]
    if not orphans:
        return []
    index = part.directory / INDEX_FILE
    if orphans == [shard_name(len(entries))]:
        if not torn and not live:  # a torn line already warned about this record
            warnings.warn(
                f"{part.directory / orphans[0]} is not listed in {index}: the last record of a "
                "writer that was killed before indexing it. It is ignored (and removed by the "
                "next writer); GradientStorageManager.repair(save_dir) would re-index it instead.",
                UserWarning,
                stacklevel=4,
            )
        return orphans
    shown = ", ".join(orphans[:3]) + (", ..." if len(orphans) > 3 else "")
    raise StoreFormatError(
        f"{index} does not list {len(orphans)} shard(s) of its partition ({shown}): index lines "
        f"were lost (a deleted line or a truncated index), so these records would be silently "
        f"dropped. {_REPAIR_HINT}"
    )


def check_duplicate_records(entries: list[tuple[Partition, IndexEntry]]) -> None:
    """Refuse the same record (step, checkpoint, samples, size and CRC-32) in two partitions.

    Raises:
        StoreFormatError: naming both shard files.
    """
    if len({id(part) for part, _ in entries}) < 2:
        return  # one partition: a repeated record is a step that really saw it twice
    # group by the fields an index row holds first: a record's ids are compared (and, from a
    # binary index, decoded) only where two partitions hold records of equal size and CRC-32
    cheap: dict[tuple, list[tuple[Partition, IndexEntry]]] = {}
    for part, e in entries:
        cheap.setdefault((e["step"], e["checkpoint"], e["crc32"], e["bytes"]), []).append((part, e))
    seen: dict[tuple, tuple[Partition, IndexEntry]] = {}
    for group in cheap.values():
        if len({id(p) for p, _ in group}) < 2:
            continue
        for part, e in group:
            _check_copy(seen, part, e)


def _check_copy(
    seen: dict[tuple, tuple[Partition, IndexEntry]], part: Partition, e: IndexEntry
) -> None:
    key = (e["step"], e["checkpoint"], e["crc32"], e["bytes"], tuple(e["hashes"]))
    other = seen.setdefault(key, (part, e))
    if other[0] is not part:
        first = other[0].directory / other[1]["shard"]
        raise StoreFormatError(
            f"{part.directory / e['shard']} is a byte-identical copy of {first} (same step "
            f"{e['step']}, samples and CRC-32) in another partition: every score of its "
            f"{e['n']} sample(s) would count twice. Remove the copied partition. (If two "
            "ranks really computed the same batch, e.g. a dataset smaller than the world "
            "size padded by DistributedSampler, open the store with "
            "GradientStorageManager(save_dir, allow_duplicate_records=True).)"
        )
