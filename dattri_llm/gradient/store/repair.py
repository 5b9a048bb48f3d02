"""Rebuilding a partition's index from its shards (``GradientStorageManager.repair(save_dir)``).

Every shard carries its own header (layer schema, or from version 3 the digest of its
partition's layer table; step, checkpoint, hashes, metadata), so a damaged index can be
rebuilt from the shards: lost or duplicated lines, a truncated index, or
lines that disagree with their shard. The old index still vouches for the data: a shard whose
size and CRC-32 match one of its old lines is intact and is re-indexed from its header; a shard
an old line names but whose CRC-32 matches no line is corrupted and moved to ``quarantine/``;
a shard no line names (its line was lost) is re-indexed from its header when the header and
tensors read back, else quarantined. Write order (``seq``) is kept; the shards are renumbered
``0..n-1`` and the index is replaced atomically, so a crash during repair leaves a store that
readers refuse and a second repair finishes. A missing or corrupted layer table is not
repaired (every shard of its schema would be quarantined): repair raises naming it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open

from dattri_llm.gradient.store.binary_index import (
    RECORDS_FILE,
    uses_binary_index,
    write_binary_index,
)
from dattri_llm.gradient.store.format import (
    INDEX_FILE,
    SHARD_DIR,
    SHARD_METADATA_KEY,
    LayerTableError,
    StoreFormatError,
    decode_schema,
    file_crc32,
    read_meta,
    tensor_keys,
)
from dattri_llm.gradient.store.index import IndexEntry, entry_for, parse_lines, shard_name
from dattri_llm.gradient.store.partition import Partition, shard_files
from dattri_llm.gradient.store.writer import live_writer, lock_partition

__all__ = ["RepairReport", "repair_partition"]

QUARANTINE_DIR = "quarantine"


@dataclass
class RepairReport:
    """What :func:`repair_partition` did to one partition.

    Attributes:
        partition: The partition directory.
        records: Records in the rebuilt index.
        reindexed: Shards that no index line named and were indexed from their headers (their
            data cannot be checked against an old CRC-32).
        corrected: Shards whose old line disagreed with their (intact) header.
        quarantined: Shards moved to ``quarantine/``, with the reason.
        dropped_lines: Old index lines not used (duplicates, unreadable, or naming a missing
            or quarantined shard).
    """

    partition: Path
    records: int = 0
    reindexed: list[str] = field(default_factory=list)
    corrected: list[str] = field(default_factory=list)
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    dropped_lines: int = 0

    @property
    def changed(self) -> bool:
        """Whether the index needed any change."""
        return bool(self.reindexed or self.corrected or self.quarantined or self.dropped_lines)


def _seq_key(name: str) -> tuple[int, int | str]:
    stem = Path(name).stem
    return (0, int(stem)) if stem.isdigit() else (1, stem)


def _read_shard(path: Path, n_bytes: int, crc: int) -> IndexEntry:
    """The index entry a shard's own header describes (raises on an unreadable shard)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = decode_schema(f.metadata().get(SHARD_METADATA_KEY), path)
            n = len(header["hashes"])
            for k in tensor_keys(header["layers"]):
                shape = f.get_slice(k).get_shape()
                if not shape or shape[0] != n:
                    raise StoreFormatError(f"tensor {k!r} of {path} has {shape} rows for {n}")
    except LayerTableError:
        raise
    except (SafetensorError, OSError, KeyError, ValueError) as e:
        raise StoreFormatError(f"{path} cannot be read: {e}") from None
    return entry_for(-1, header, n_bytes, crc)


def repair_partition(part: Partition) -> RepairReport:
    """Rebuild one partition's index from its shards (under its writer lock).

    Raises:
        RuntimeError: a writer (of this or another process) is open on the partition.
    """
    directory = part.directory
    if live_writer(directory) is not None:
        raise RuntimeError(
            f"a GradientStorageManager of this process is writing {directory}; close() it "
            "before repairing it."
        )
    report = RepairReport(directory)
    lock = lock_partition(directory)
    try:
        index = directory / INDEX_FILE
        old, bad_lines = parse_lines(index)
        report.dropped_lines = bad_lines
        shard_dir = directory / SHARD_DIR
        for p in shard_dir.iterdir() if shard_dir.is_dir() else []:
            if p.name.startswith(".") and p.is_file():
                p.unlink()  # a killed writer's temp file
        files = sorted(shard_files(directory), key=_seq_key)
        keys = {rel: (p.stat().st_size, file_crc32(p)) for rel in files if (p := directory / rel)}
        vouch = _assign_lines(files, keys, old)
        named = {e["shard"] for e in old}
        vouched_keys = {keys[rel] for rel in vouch}
        kept: list[tuple[str, IndexEntry]] = []
        seen: set[tuple[int, int]] = set()
        for rel in files:
            line = vouch.get(rel)
            if line is None:
                if keys[rel] in vouched_keys or keys[rel] in seen:
                    _quarantine(directory, rel, "a byte-identical copy of another shard", report)
                    continue
                if rel in named:
                    _quarantine(directory, rel, "its CRC-32 matches no index line", report)
                    continue
            try:
                entry = _read_shard(directory / rel, *keys[rel])
            except LayerTableError:
                raise  # every shard of the schema would go: the table is to be restored
            except StoreFormatError as e:
                _quarantine(directory, rel, str(e), report)
                continue
            if line is None:
                report.reindexed.append(rel)
            elif any(line.get(k) != entry.get(k) for k in {*line, *entry} - {"seq", "shard"}):
                report.corrected.append(rel)
            seen.add(keys[rel])
            kept.append((rel, entry))
        report.dropped_lines += len(old) - len(vouch)
        _rewrite(directory, kept, old)
        report.records = len(kept)
    finally:
        if lock is not None:
            lock.close()
    return report


def _assign_lines(
    files: list[str], keys: dict[str, tuple[int, int]], old: list[IndexEntry]
) -> dict[str, IndexEntry]:
    """Which old line vouches for which shard: same size and CRC-32, one shard per line.

    A line vouches first for the shard it names, then for another byte-identical one (a shard
    renamed by an interrupted repair).
    """
    free: dict[tuple[int, int], list[IndexEntry]] = {}
    for e in old:
        free.setdefault((e["bytes"], e["crc32"]), []).append(e)
    out: dict[str, IndexEntry] = {}
    for rel in files:  # the line naming the file
        lines = free.get(keys[rel], [])
        match = next((e for e in lines if e["shard"] == rel), None)
        if match is not None:
            lines.remove(match)
            out[rel] = match
    for rel in files:  # any other byte-identical line
        lines = free.get(keys[rel], [])
        if rel not in out and lines:
            out[rel] = lines.pop(0)
    return out


def _quarantine(directory: Path, rel: str, why: str, report: RepairReport) -> None:
    target = directory / QUARANTINE_DIR
    target.mkdir(exist_ok=True)
    name = Path(rel).name
    os.replace(directory / rel, target / name)
    report.quarantined.append((f"{QUARANTINE_DIR}/{name}", why))


def _rewrite(directory: Path, kept: list[tuple[str, IndexEntry]], old: list[IndexEntry]) -> None:
    """Write the new index (temp file), renumber the shards, then replace the index."""
    lines = []
    for seq, (_, entry) in enumerate(kept):
        entry["seq"], entry["shard"] = seq, shard_name(seq)
        lines.append(json.dumps(entry, separators=(",", ":"), allow_nan=False) + "\n")
    unchanged = [e for _, e in kept] == old and all(rel == e["shard"] for rel, e in kept)
    binary = uses_binary_index(read_meta(directory))
    if not unchanged:
        tmp = directory / f".{INDEX_FILE}.repair.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        if binary:  # stale rows must not outlive the old journal: removed until rebuilt below
            (directory / RECORDS_FILE).unlink(missing_ok=True)
        for rel, entry in kept:  # ascending seq: a target name is never a shard still to move
            if rel != entry["shard"]:
                os.replace(directory / rel, directory / entry["shard"])
        os.replace(tmp, directory / INDEX_FILE)
    if binary:  # rebuilt from the journal just written (always: it may be the damaged part)
        write_binary_index(directory, [e for _, e in kept], "".join(lines).encode())
