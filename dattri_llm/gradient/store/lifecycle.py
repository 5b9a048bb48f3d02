"""What opening a store for writing does to the records already in it (``mode=``).

* ``"create"`` (default): the store must hold no records yet (other than the ones the same
  manager wrote earlier), so re-running a capture never silently doubles every score.
* ``"append"``: add records after the existing ones (resume an interrupted capture, add a
  checkpoint); ``OffloadCallback`` continues the step numbers after the last stored step.
* ``"overwrite"``: delete the store's records first.

A writer *owns* its partition (the root for one process, ``rank_<rank>/`` under
``torch.distributed``); the checks and the deletion also cover the partitions no rank of the
current run writes (the root's under ``torch.distributed``, ``rank_N/`` beyond the world size,
``rank_N/`` in a single-process run), so a stale partition cannot join the new records.
Partitions owned by the other ranks of the run are theirs to check.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dattri_llm.gradient.store.binary_index import RECORDS_FILE, SAMPLES_FILE
from dattri_llm.gradient.store.format import INDEX_FILE, KRONECKER_FILE, SHARD_DIR, write_meta
from dattri_llm.gradient.store.index import parse_index
from dattri_llm.gradient.store.partition import Partition, discover_partitions, shard_files
from dattri_llm.gradient.store.writer import live_writer, lock_partition

__all__ = ["MODES", "prepare_store", "foreign_partitions", "check_empty", "clear_partition"]

MODES = ("create", "append", "overwrite")


def foreign_partitions(
    root: Path, own: Path, distributed: bool, world_size: int
) -> list[Partition]:
    """Partitions of ``root`` that no rank of the current run writes (``own`` excluded)."""
    out = []
    for part in discover_partitions(root):
        if part.directory == own:
            continue
        if distributed and part.directory != root and part.rank < world_size:
            continue  # another rank's own partition
        out.append(part)
    return out


def _count(part: Partition) -> int:
    writer = live_writer(part.directory)
    if writer is not None:
        writer.flush()  # an unclosed writer of this process: its records count too
    entries, _, _ = parse_index(part.directory / INDEX_FILE, warn=False)
    return max(len(entries), len(shard_files(part.directory)))


def check_empty(root: Path, parts: list[Partition]) -> None:
    """Refuse ``mode="create"`` on partitions that already hold records.

    Raises:
        FileExistsError: naming the store, the number of records and the two fixes.
    """
    held = {p.directory: n for p in parts if (n := _count(p))}
    if held:
        total = sum(held.values())
        where = ", ".join(str(d) for d in list(held)[:3])
        raise FileExistsError(
            f"the gradient store {root} already holds {total} record(s) (in {where}); writing "
            "into it again would count every sample twice. Pass GradientStorageManager(..., "
            "mode='append') to add to it (e.g. resume an interrupted capture: OffloadCallback "
            "continues the steps after the last stored one), mode='overwrite' to replace it, "
            "or use a new save_dir."
        )


def clear_partition(part: Partition, root: Path) -> None:
    """Delete a partition's records (under its writer lock): index first, then shards.

    A ``rank_N/`` partition is removed entirely; the root keeps its ``meta.json``. A crash in
    between leaves shards without index lines, which readers refuse (never a silent mix).
    """
    writer = live_writer(part.directory)
    if writer is not None:
        writer.close()
    lock = lock_partition(part.directory)
    try:
        for name in (RECORDS_FILE, SAMPLES_FILE, KRONECKER_FILE):  # derived from the records
            (part.directory / name).unlink(missing_ok=True)
        index = part.directory / INDEX_FILE
        if index.exists():
            os.truncate(index, 0)
            index.unlink()
        shards = part.directory / SHARD_DIR
        if shards.is_dir():
            shutil.rmtree(shards)
    finally:
        if lock is not None:
            lock.close()
    if part.directory != root:
        shutil.rmtree(part.directory, ignore_errors=True)


def prepare_store(
    root: Path, directory: Path, mode: str, rank: int, world_size: int, distributed: bool
) -> None:
    """Apply ``mode`` before a writer opens ``directory`` (its own partition) under ``root``.

    ``"create"`` checks the own and the foreign partitions are empty; ``"overwrite"`` deletes
    the foreign ones (rank 0 only; the writer clears its own partition under its lock).

    Raises:
        FileExistsError: ``mode="create"`` and records are there.
    """
    root.mkdir(parents=True, exist_ok=True)
    foreign = foreign_partitions(root, directory, distributed, world_size)
    own = [Partition(rank, directory)] if (directory / INDEX_FILE).exists() else []
    if mode == "create":
        check_empty(root, own + foreign)
    elif mode == "overwrite" and rank == 0:
        for part in foreign:  # rank 0 alone clears what no rank of this run writes
            clear_partition(part, root)
    if distributed:
        write_meta(root, {"layout": "ranks"})
