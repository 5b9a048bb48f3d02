"""Writing one store partition (a rank's directory): crash-safe shards, optional background thread.

Write protocol of one record (the order is what makes a crash lose at most that record):

1. ``shards/.{seq}.safetensors.tmp`` is written and fsynced, and its CRC-32 computed;
2. it is renamed to ``shards/{seq}.safetensors`` and the directory is fsynced;
3. the index line is appended to ``index.jsonl`` and fsynced.

In a version-3 partition the shard header refers to layer tables by digest; a table the
partition lacks is written (temp file, fsync, rename) before the first shard that refers to it,
so a durable shard never refers to a table that is not.

With ``async_write`` the three steps run on a background thread; at most ``max_pending``
records (default 1) are accepted but not yet durable, so a crash loses at most that many.

One writer per partition: other processes are kept out with ``flock``; within one process a
new writer of a partition takes over from an earlier one that was never closed (an
interrupted notebook cell): the earlier one is flushed and closed, with a warning.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.store.binary_index import (
    BinaryAppender,
    BinaryIndex,
    line_spans,
    uses_binary_index,
)
from dattri_llm.gradient.store.format import (
    INDEX_FILE,
    KRONECKER_FILE,
    SHARD_DIR,
    SHARD_METADATA_KEY,
    TABLE_DIR,
    StoreFormatError,
    encode_record,
    file_crc32,
    read_meta,
    read_table,
    schema_fingerprint,
    table_blob,
    uses_tables,
    write_meta,
)
from dattri_llm.gradient.store.index import IndexAppender, IndexEntry, entry_for, read_index
from dattri_llm.gradient.store.partition import Partition, check_unindexed
from dattri_llm.utils.files import atomic_write, fsync_dir

try:  # advisory lock against two writers on one partition (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = ["PartitionWriter", "live_writer", "lock_partition"]

LOCK_FILE = ".writer.lock"
#: The open writers of this process, by partition directory.
_LIVE: dict[str, weakref.ref[PartitionWriter]] = {}
_LIVE_LOCK = threading.Lock()


def _key(directory: Path) -> str:
    return str(Path(directory).resolve())


def live_writer(directory: Path) -> PartitionWriter | None:
    """The open writer of ``directory`` in this process, if any."""
    with _LIVE_LOCK:
        ref = _LIVE.get(_key(directory))
    writer = ref() if ref is not None else None
    return writer if writer is not None and not writer.closed else None


def lock_partition(directory: Path) -> object | None:
    """Take the partition's writer lock (``flock``, POSIX) or raise naming the directory.

    Returns:
        The open lock file (closing it releases the lock), or ``None`` without ``fcntl``.

    Raises:
        RuntimeError: another process holds the lock.
    """
    if fcntl is None:
        return None
    f = open(directory / LOCK_FILE, "a")  # noqa: SIM115 - held while writing
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RuntimeError(
            f"another process is writing to {directory}; one writer per partition (wait for it "
            "to finish, or use a different save_dir)."
        ) from None
    return f


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def write_shard(
    directory: Path,
    seq: int,
    tensors: Mapping[str, torch.Tensor],
    fsync: bool,
    metadata: dict[str, str] | None = None,
) -> tuple[str, int, int]:
    """Write ``directory/<seq>.safetensors`` crash-safely; return ``(name, crc32, bytes)``.

    A hidden temporary file is written (and fsynced with ``fsync``), then renamed, then the
    directory is fsynced: a kill leaves the complete file or only the temporary one.
    """
    name = f"{seq:09d}.safetensors"
    tmp, final = directory / f".{name}.tmp", directory / name
    save_file(dict(tensors), str(tmp), metadata=metadata)
    crc, size = file_crc32(tmp), tmp.stat().st_size
    if fsync:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.replace(tmp, final)
    if fsync:
        fsync_dir(directory)
    return name, crc, size


def write_table(directory: Path, value: object, fsync: bool) -> str:
    """Write the layer table of ``value`` into the partition ``directory``; return its digest.

    Crash-safe like a shard: a hidden temp file, fsynced, renamed, the directory fsynced.
    """
    digest = schema_fingerprint(value)
    tables = directory / TABLE_DIR
    new_dir = not tables.is_dir()
    tables.mkdir(exist_ok=True)
    if new_dir and fsync:
        fsync_dir(directory)
    atomic_write(tables / f"{digest}.json", table_blob(value), fsync=fsync)
    if fsync:
        fsync_dir(tables)
    return digest


def open_binary(
    directory: Path, entries: list[IndexEntry], valid: int, clear: bool, fsync: bool
) -> BinaryAppender:
    """The binary index appender of a version-2 partition, caught up with its journal.

    Rows the journal backs (same fields, same journal bytes by CRC-32) are kept; the rows of
    records the journal lists beyond them (a writer killed between its line and its row, an
    index deleted) are appended; a binary index that does not match the journal is rebuilt
    from it.
    """
    index = BinaryIndex(directory, warn=False)
    with open(directory / INDEX_FILE, "a+b") as f:
        f.seek(0)
        data = f.read(valid)
    rows = 0 if clear else index.num_records
    if rows and (
        rows > len(entries)
        or zlib.crc32(data[: index.journal_end]) != index.journal_crc
        or any(
            not np.array_equal(index.column(k), [e[k] for e in entries[:rows]])
            for k in ("seq", "step", "checkpoint", "n", "bytes", "crc32")
        )
    ):
        rows = 0  # stale: rebuilt from the journal below
    index.keep(rows)
    appender = BinaryAppender(directory, index, zlib.crc32(data[: index.journal_end]), fsync)
    for entry, (off, length) in zip(entries[rows:], line_spans(data)[rows:]):
        appender.append(entry, off, data[off : off + length])
    return appender


class PartitionWriter:
    """Appends records to one partition directory.

    Args:
        directory: The partition (the store root, or ``rank_N/`` under it).
        meta: Extra ``meta.json`` fields of the partition (rank, world size).
        on_durable: Called with each index entry once the record is durable.
        async_write: Write on a background thread.
        max_pending: Records accepted but not yet durable (the most a crash can lose).
        fsync: fsync shards, directory and index (turn off only for scratch stores).
        clear: Delete the partition's records first (``mode="overwrite"``).
        known: ``(entries, index size)`` the same manager left when it closed its writer:
            reused instead of parsing the index again when the index still has that size.

    Raises:
        RuntimeError: another process writes the partition.
        StoreFormatError: the partition's index is corrupted or does not account for its
            shards (see :func:`~dattri_llm.gradient.store.partition.check_unindexed`).
    """

    def __init__(
        self,
        directory: Path,
        meta: dict,
        on_durable: Callable[[IndexEntry], None],
        async_write: bool = True,
        max_pending: int = 1,
        fsync: bool = True,
        clear: bool = False,
        known: tuple[list[IndexEntry], int] | None = None,
    ) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.directory = directory
        self.fsync = fsync
        self._on_durable = on_durable
        self._taken_over = False
        self._closed = True  # until the lock is held
        directory.mkdir(parents=True, exist_ok=True)
        write_meta(directory, meta)
        old = live_writer(directory)
        if old is not None:
            old._taken_over = True
            warnings.warn(
                f"{directory}: another writer of this process was still open (a capture "
                "interrupted before its GradientStorageManager was closed?); its records were "
                "flushed and it was closed, and this writer takes over.",
                UserWarning,
                stacklevel=4,
            )
            old.close()
        self._lock_file = lock_partition(directory)
        try:
            self.shard_dir = directory / SHARD_DIR
            self.shard_dir.mkdir(exist_ok=True)
            if clear:
                entries, valid = [], 0
                (directory / KRONECKER_FILE).unlink(missing_ok=True)  # of the deleted records
                IndexAppender(directory / INDEX_FILE, 0, fsync=fsync).close()  # truncate first
            elif known is not None and _size(directory / INDEX_FILE) == known[1]:
                entries, valid = list(known[0]), known[1]  # nobody appended since we closed
            else:
                entries, valid = read_index(directory / INDEX_FILE, warn=False)
                check_unindexed(Partition(0, directory), entries, torn=True)
            self._cleanup({e["shard"] for e in entries}, quiet=clear)
            self._index = IndexAppender(directory / INDEX_FILE, valid, fsync=fsync)
            meta_now = read_meta(directory)
            self._binary = (
                open_binary(directory, entries, valid, clear, fsync)
                if uses_binary_index(meta_now)
                else None
            )
            # the digests of the layer tables checked present (None: an older partition, whose
            # headers keep their schema inline so that older readers still read it)
            self._tables: set[str] | None = set() if uses_tables(meta_now) else None
            if clear and self._tables is not None:
                for p in (directory / TABLE_DIR).glob("*.json"):
                    p.unlink()  # of the deleted records
        except BaseException:
            if self._lock_file is not None:
                self._lock_file.close()
            raise
        #: The partition's records when the writer opened (in order).
        self.entries: list[IndexEntry] = list(entries)
        self._seq = len(entries)
        self._error: BaseException | None = None
        self._closed = False
        with _LIVE_LOCK:
            _LIVE[_key(directory)] = weakref.ref(self)
        self._async = async_write
        if async_write:
            self._slots = threading.Semaphore(max_pending)
            self._cv = threading.Condition()
            self._queue: list[tuple[int, dict, dict] | None] = []
            self._pending = 0
            self._thread = threading.Thread(
                target=self._run, name="dattri-store-writer", daemon=True
            )
            self._thread.start()
            # a normal interpreter exit without close() still makes accepted records durable
            ref = weakref.WeakMethod(self.close)
            self._atexit = lambda: ref() and ref()()
            atexit.register(self._atexit)

    # ---- setup --------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the writer was closed (or taken over)."""
        return self._closed

    @property
    def taken_over(self) -> bool:
        """Whether a newer writer of this process took the partition over."""
        return self._taken_over

    def _cleanup(self, referenced: set[str], quiet: bool = False) -> None:
        """Remove temp files and shards no index line points at (a killed writer's leftovers).

        Temp files are the hidden ones: ours (``.{name}.tmp``) and safetensors' own (its
        ``save_file`` writes a ``.tmpXXXXXX`` file next to the target, then renames it).
        """
        tables = self.directory / TABLE_DIR
        for p in tables.iterdir() if tables.is_dir() else []:
            if p.name.startswith(".") and p.is_file():
                p.unlink()  # a killed writer's temp table (never referred to)
        removed = []
        for name in os.listdir(self.shard_dir):
            if name.startswith("."):
                if not (self.shard_dir / name).is_file():
                    continue
            elif not name.endswith(".safetensors") or f"{SHARD_DIR}/{name}" in referenced:
                continue
            (self.shard_dir / name).unlink()
            removed.append(name)
        if removed and not quiet:
            warnings.warn(
                f"{self.directory}: removed {len(removed)} unfinished shard file(s) of an "
                f"interrupted writer ({', '.join(sorted(removed)[:3])}"
                f"{', ...' if len(removed) > 3 else ''}).",
                UserWarning,
                stacklevel=4,
            )

    # ---- writing ------------------------------------------------------------------------------
    def write(
        self, record: GradientRecord, extra: dict | None = None, storage: dict | None = None
    ) -> int:
        """Persist one record (blocks while ``max_pending`` records are in flight).

        ``storage`` (JSON) goes into the shard header only: how the record was stored
        (``docs/STORE_FORMAT.md``, "Compact storage").

        Returns:
            The record's ``seq`` in the partition.
        """
        self._raise_pending()
        if self._taken_over:
            raise RuntimeError(
                f"this GradientStorageManager no longer writes {self.directory}: a newer one in "
                "this process took the partition over. Write through the newer manager."
            )
        if self._closed:
            raise RuntimeError(f"the writer of {self.directory} is closed.")
        tensors, header = encode_record(record)
        if extra is not None:
            json.dumps(extra, allow_nan=False)  # fail here, not on the thread
            header["extra"] = extra
        if storage is not None:
            json.dumps(storage, allow_nan=False)
            header["storage"] = storage
        seq = self._seq
        self._seq += 1
        if not self._async:
            self._write_now(seq, tensors, header)
            return seq
        self._slots.acquire()
        self._raise_pending()
        with self._cv:
            self._queue.append((seq, tensors, header))
            self._pending += 1
            self._cv.notify_all()
        return seq

    def _table(self, value: object) -> str:
        """The digest of ``value``'s layer table, written first if the partition lacks it."""
        digest = schema_fingerprint(value)
        if digest not in self._tables:
            try:  # present and intact (an earlier writer's)?
                read_table(self.directory, digest, self.directory)
            except StoreFormatError:
                write_table(self.directory, value, self.fsync)
            self._tables.add(digest)
        return digest

    def _on_disk(self, header: dict) -> dict:
        """The header as the shard holds it: layer schema and storage choices by table digest.

        Sets ``header["schema"]`` (the schema's digest, for the index line) on the way.
        """
        if self._tables is None:
            return header
        header["schema"] = self._table(header["layers"])
        disk = {k: v for k, v in header.items() if k != "schema"}
        disk["layers"] = header["schema"]
        storage = header.get("storage")
        if isinstance(storage, dict) and isinstance(storage.get("layers"), dict):
            disk["storage"] = {**storage, "layers": self._table(storage["layers"])}
        return disk

    def _write_now(self, seq: int, tensors: dict[str, torch.Tensor], header: dict) -> None:
        disk = self._on_disk(header)
        meta = {SHARD_METADATA_KEY: json.dumps(disk, separators=(",", ":"), allow_nan=True)}
        _, crc, size = write_shard(self.shard_dir, seq, tensors, self.fsync, meta)
        entry = entry_for(seq, header, size, crc)
        off, line = self._index.append(entry)
        if self._binary is not None:
            self._binary.append(entry, off, line)
        self._on_durable(entry)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                item = self._queue.pop(0)
            if item is None:
                return
            try:
                if self._error is None:
                    self._write_now(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
                self._slots.release()

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a record to {self.directory} failed: {err}") from err

    def flush(self) -> None:
        """Block until every accepted record is durable (re-raises a background failure)."""
        if self._async:
            with self._cv:
                while self._pending:
                    self._cv.wait()
        self._raise_pending()

    def close(self) -> None:
        """Flush, stop the thread, close the index and release the lock (idempotent)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._async:
                with self._cv:
                    self._queue.append(None)
                    self._cv.notify_all()
                self._thread.join()
                atexit.unregister(self._atexit)
            self._index.close()
            if self._binary is not None:
                self._binary.close()
            if self._lock_file is not None:
                self._lock_file.close()
            with _LIVE_LOCK:
                ref = _LIVE.get(_key(self.directory))
                if ref is not None and ref() is self:
                    del _LIVE[_key(self.directory)]
