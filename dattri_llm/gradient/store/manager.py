"""``GradientStorageManager``: the on-disk gradient store (write, index, merged reads).

A store is a directory. Records (one :class:`~dattri_llm.GradientRecord` each) live in
safetensors shards with a JSONL index; under ``torch.distributed`` every rank writes its own
``rank_N/`` partition and opening the root merges all of them. The format is documented in
``docs/STORE_FORMAT.md``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from dattri_llm.gradient.compat import CaptureFacts
from dattri_llm.gradient.gradient import Gradient, GradientBlock, GradientRecord
from dattri_llm.gradient.store.binary_index import (
    entry_column,
    read_partition,
    uses_binary_index,
)
from dattri_llm.gradient.store.finite import (
    NONFINITE_MODES,
    find_nonfinite,
    nonfinite_error,
)
from dattri_llm.gradient.store.format import (
    FORMAT_VERSION,
    INDEX_FILE,
    SHARD_METADATA_KEY,
    decode_json,
    decode_schema,
    read_meta,
)
from dattri_llm.gradient.store.index import IndexEntry, check_sequence, parse_index
from dattri_llm.gradient.store.kronecker_stats import (
    StatisticsRecorder,
    StoreStatistics,
    read_statistics,
)
from dattri_llm.gradient.store.lifecycle import MODES, prepare_store
from dattri_llm.gradient.store.lookup import SampleLocation, SampleLocator
from dattri_llm.gradient.store.partition import Partition as _Partition
from dattri_llm.gradient.store.partition import (
    check_duplicate_records,
    check_unindexed,
    discover_partitions,
)
from dattri_llm.gradient.store.repair import RepairReport, repair_partition
from dattri_llm.gradient.store.shard import (
    check_header_matches,
    merge_schema_facts,
    open_shard,
    read_gradient,
    shard_dtype,
)
from dattri_llm.gradient.store.verified import VerifiedShards, identity
from dattri_llm.gradient.store.writer import PartitionWriter
from dattri_llm.utils.distributed import get_rank, get_world_size, is_distributed
from dattri_llm.utils.hashing import hash_sample
from dattri_llm.utils.names import close_candidates

__all__ = ["GradientStorageManager", "RecordInfo"]


class RecordInfo(NamedTuple):
    """Where one record lives.

    Attributes:
        rank: Partition rank (0 for a single-process store).
        seq: Write order within the partition.
        step: The record's step.
        checkpoint: The record's checkpoint label.
        hashes: One sample identity per row.
        path: The shard file.
    """

    rank: int
    seq: int
    step: int
    checkpoint: int
    hashes: list[str]
    path: Path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _metadata(entry: IndexEntry) -> dict:
    """A record's metadata (see ``GradientRecord.metadata``), decoded from its index line."""
    return decode_json(entry.get("metadata", {}))


def _shared_keys(sources: list[tuple[_Partition, Sequence[IndexEntry]]]) -> bool:
    """Whether two partitions hold records of equal step, checkpoint, size and CRC-32.

    Only then can a partition be a copy of another (``check_duplicate_records`` then compares
    the records' samples); found from the index columns, without entry objects.
    """
    if sum(1 for _, src in sources if len(src)) < 2:
        return False
    seen: dict[tuple[int, ...], int] = {}
    for k, (_, src) in enumerate(sources):
        cols = [entry_column(src, f).tolist() for f in ("step", "checkpoint", "crc32", "bytes")]
        for key in set(zip(*cols)):
            if seen.setdefault(key, k) != k:
                return True
    return False


class GradientStorageManager:
    """Read and write a gradient store in ``save_dir``.

    Writing: pass it to ``OffloadCallback(file_manager=...)`` or call :meth:`write`; the
    directory is created on the first write. What happens to records already in the store is
    ``mode``: by default (``"create"``) the first write refuses a store that already holds
    records, so re-running a capture cannot silently count every sample twice; ``"append"``
    adds to them (resume an interrupted capture: ``OffloadCallback`` continues the steps after
    the last stored one), ``"overwrite"`` deletes them first. Records this manager wrote are
    always appended to (several capture contexts, several checkpoints). Under an initialised
    ``torch.distributed`` group each rank writes ``rank_N/``. Call :meth:`close` (or use
    ``with``; ``OffloadCallback`` does when its capture context ends) so the last records
    become durable and the partition is released.

    Reading: the store merges every partition; records come in *store order* — by rank, then
    step, then write order. ``len(store)`` is the number of records. What the reader checks
    (and :meth:`repair` fixes) is listed in ``docs/STORE_FORMAT.md``.

    Args:
        save_dir: The store directory.
        mode: ``"create"`` (default), ``"append"`` or ``"overwrite"`` (see above; reading
            is the same in every mode).
        async_write: Write shards on a background thread.
        max_pending: Records accepted by :meth:`write` but not yet durable (so a crash loses at
            most this many; default 1: only the in-flight record).
        fsync: fsync shards and index lines (turn off only for scratch stores).
        verify: Check a shard's CRC-32 against the index the first time this process reads
            that file (``store/verified.py``: by file identity, so a replaced shard is checked
            again; size, header and hashes are checked on every read); ``False`` skips the
            full-file checksum (faster first reads, but a flipped bit in a tensor goes unseen).
        allow_duplicate_records: Accept byte-identical records in two partitions (two ranks
            that computed the very same batch); by default that is refused as a copied
            partition.
        nonfinite: What :meth:`write` does with a record holding an ``inf`` / ``NaN``
            gradient value: ``"error"`` (default) refuses it with a
            :class:`~dattri_llm.gradient.store.finite.NonFiniteGradientError` naming the sample,
            the layer and the record, and the fix (an overflow of ``storage_dtype="float16"``
            is told apart from a diverged step); ``"warn"`` writes it with a warning (the first
            one only). Scoring ranks a NaN score after every finite one either way.

    Raises:
        StoreFormatError: ``save_dir`` holds files but is not a store, a store of an
            unsupported format version, or a damaged one (naming the file).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        *,
        mode: str = "create",
        async_write: bool = True,
        max_pending: int = 1,
        fsync: bool = True,
        verify: bool = True,
        allow_duplicate_records: bool = False,
        nonfinite: str = "error",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE_MODES} (what write() does with an inf / "
                f"NaN gradient), got {nonfinite!r}."
            )
        self.nonfinite = nonfinite
        self._nonfinite_warned = False
        self.save_dir = Path(save_dir)
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise NotADirectoryError(f"save_dir {self.save_dir} exists and is not a directory.")
        self.mode = mode
        self.async_write = async_write
        self.max_pending = max_pending
        self.fsync = fsync
        self.verify = verify
        self.allow_duplicate_records = allow_duplicate_records
        self._lock = threading.RLock()
        self._writer: PartitionWriter | None = None
        self._writer_part: _Partition | None = None
        self._opened = False  # a writer was opened once: later ones append to our records
        self._own: list[IndexEntry] = []  # the durable records of our open writer's partition
        self._known: tuple[Path, tuple[list[IndexEntry], int]] | None = None  # at our close
        self._sources: list[tuple[_Partition, Sequence[IndexEntry]]] = []
        self._extra: list[tuple[_Partition, IndexEntry]] = []  # durable since the refresh
        self._flat: list[tuple[_Partition, IndexEntry]] | None = None
        self._order: list[int] | None = None
        self._ordered_list: list[tuple[_Partition, IndexEntry]] = []
        self._locator: SampleLocator | None = None  # of the current store order
        self._headers: dict[tuple[int, str], dict] = {}
        #: Which shards this process has CRC-checked (process-wide, by file identity).
        self.shard_checks = VerifiedShards()
        # what a writer puts into a new partition's ``meta.json`` (see ``configure``)
        self._partition_meta: dict[str, Any] = {}
        self._statistics = StatisticsRecorder()  # sums of our records not yet saved
        self.refresh()

    def configure(
        self,
        *,
        storage: Mapping[str, Any] | None = None,
        coverage: Mapping[str, Any] | None = None,
    ) -> None:
        """Say how this manager's records are stored and what the capture covered.

        Both are written into the ``meta.json`` of the partition the next writer opens
        (``OffloadCallback`` calls this at registration and before each write); they are
        informational (``dattri-llm inspect`` shows them): the shard headers stay authoritative.

        Args:
            storage: The storage choices (``compact``, ``keep_token_factors``,
                ``storage_dtype``; see :func:`~dattri_llm.gradient.store.compact.storage_settings`).
            coverage: The share of trainable parameters captured (``Coverage.to_dict()``).
        """
        if storage is not None:
            self._partition_meta["storage"] = dict(storage)
        if coverage is not None:
            self._partition_meta["coverage"] = dict(coverage)

    # ---- discovery ------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read every partition's index (see records written by other processes).

        Raises:
            StoreFormatError: a corrupted index, a partition copied under another rank, shards
                no index line accounts for, or the same record in two partitions.
        """
        with self._lock:
            sources: list[tuple[_Partition, Sequence[IndexEntry]]] = []
            writing = self._writer is not None and not self._writer.closed
            own = self._writer_part.directory if writing and self._writer_part else None
            for part in discover_partitions(self.save_dir):
                if part.directory == own:  # our writer's records (in flight ones excluded)
                    sources.append((part, list(self._own)))
                    continue
                path = part.directory / INDEX_FILE
                if uses_binary_index(read_meta(part.directory)):
                    found, torn = read_partition(part.directory)
                else:  # a version-1 partition: the JSONL index alone
                    found, _, torn = parse_index(path)
                    check_sequence(found, path)
                # another rank of this run may be writing its partition right now
                live = is_distributed() and part.directory != self.save_dir
                live = live and part.rank != get_rank() and part.rank < get_world_size()
                check_unindexed(part, found, torn, live=live)
                sources.append((part, found))
            if not self.allow_duplicate_records and _shared_keys(sources):
                check_duplicate_records([(p, e) for p, src in sources for e in src])
            self._sources = sources
            self._extra = []
            self._flat = None
            self._order = None

    @property
    def _entries(self) -> list[tuple[_Partition, IndexEntry]]:
        """Every ``(partition, entry)`` (entry objects made on first use, not on opening)."""
        with self._lock:
            if self._flat is None:
                self._flat = [(p, e) for p, src in self._sources for e in src] + self._extra
            return self._flat

    def _column(self, name: str) -> np.ndarray:
        """A field of every entry (partition order), without making entry objects."""
        cols = [entry_column(src, name) for _, src in self._sources]
        cols.append(np.asarray([e[name] for _, e in self._extra], dtype=np.int64))
        return np.concatenate(cols)

    def _on_durable(self, entry: IndexEntry) -> None:
        assert self._writer_part is not None
        with self._lock:
            self._own.append(entry)
            self._extra.append((self._writer_part, entry))
            if self._flat is not None:
                self._flat.append((self._writer_part, entry))
            self._order = None

    def index_entries(self) -> list[tuple[_Partition, IndexEntry]]:
        """Every record's ``(partition, index entry)``, in store order.

        For the store's own readers (``vector_reader``, ``lookup``); the list is shared (do not
        modify it) and its entries are lazy (fields are read on use).
        """
        with self._lock:
            if self._order is None:
                entries = self._entries
                parts = [p for p, src in self._sources for _ in range(len(src))]
                parts += [p for p, _ in self._extra]
                rank = np.asarray([p.rank for p in parts], dtype=np.int64)
                flat = np.asarray([p.directory != self.save_dir for p in parts], dtype=bool)
                keys = (self._column("seq"), self._column("step"), flat, rank)
                self._order = np.lexsort(keys).tolist() if entries else []
                self._locator = None
                self._ordered_list = [entries[i] for i in self._order]
            return self._ordered_list  # shared: callers read it (O(1) per call, not O(records))

    def sample_locator(self) -> SampleLocator:
        """The sample locator of the current store order (built on first use).

        The first lookup builds it (a sorted numpy array over the partitions' ``samples.bin``,
        20 bytes per sample row); each lookup is then a binary search.
        """
        ordered = self.index_entries()
        with self._lock:
            if self._locator is None or self._locator.order is not self._order:
                self._locator = SampleLocator(self._sources, self._extra, self._order, ordered)
            return self._locator

    # ---- writing --------------------------------------------------------------------------------
    def _ensure_writer(self) -> PartitionWriter:
        if self._writer is not None:
            return self._writer
        rank, world = get_rank(), get_world_size()
        directory = self.save_dir / f"rank_{rank}" if is_distributed() else self.save_dir
        mode = self.mode if not self._opened else "append"
        prepare_store(self.save_dir, directory, mode, rank, world, is_distributed())
        meta = {"rank": rank, "world_size": world, **self._partition_meta}
        with self._lock:
            self._writer = PartitionWriter(
                directory,
                meta,
                self._on_durable,
                async_write=self.async_write,
                max_pending=self.max_pending,
                fsync=self.fsync,
                clear=mode == "overwrite",
                known=self._known[1] if self._known and self._known[0] == directory else None,
            )
            self._writer_part = _Partition(rank, directory)
            reused = self._own == self._writer.entries and self._known is not None
            self._own = list(self._writer.entries)
            self._opened = True
            if not reused:  # reopened after our own close with nothing appended: up to date
                self.refresh()
        return self._writer

    def write(
        self,
        record: GradientRecord,
        extra: Mapping[str, Any] | None = None,
        storage: Mapping[str, Any] | None = None,
        *,
        statistics: Gradient | None = None,
        uncast: Gradient | None = None,
    ) -> None:
        """Append one record.

        The record's tensors are copied to CPU here; CPU tensors are written as they are, so
        they must not be modified in place until :meth:`flush` (the hook manager's never are).
        A record holding an ``inf`` / ``NaN`` is refused first (``nonfinite``).

        Args:
            record: The record to persist.
            extra: JSON-serialisable metadata kept in the record's index line.
            storage: How the record is stored (``OffloadCallback`` passes the per-layer
                compact choices and the storage / capture dtypes), kept in the shard header;
                a reader casts a record stored in a narrower dtype back to
                ``storage["capture_dtype"]``.
            statistics: The record's layers with their token factors
                (:func:`~dattri_llm.gradient.store.kronecker_stats.statistics_view`), whose
                K-FAC sums the store records beside the records (``OffloadCallback`` passes
                them when it writes a layer densely): a K-FAC / EK-FAC fit then needs no
                factors. Saved when the store flushes or closes.
            uncast: The gradient before its cast to the storage dtype (``OffloadCallback``
                passes it): read only to word the refusal of a non-finite record (an overflow
                of the cast, or a value non-finite before it).

        Raises:
            NonFiniteGradientError: the record holds an ``inf`` / ``NaN`` (``nonfinite="error"``).
        """
        writer = self._ensure_writer()  # a locked partition is named first
        found = find_nonfinite(record.gradient)
        if found is not None:
            error = nonfinite_error(record, found, uncast)
            if self.nonfinite == "error":
                raise error
            if not self._nonfinite_warned:
                self._nonfinite_warned = True
                warnings.warn(
                    f"{error} Written anyway (nonfinite='warn'); later ones are not reported.",
                    UserWarning,
                    stacklevel=2,
                )
        seq = writer.write(
            record,
            dict(extra) if extra is not None else None,
            dict(storage) if storage is not None else None,
        )
        if statistics is not None:
            self._statistics.add(seq, record.checkpoint, statistics)

    def _save_statistics(self) -> None:
        """Merge the pending Kronecker sums into the partition's file (records durable)."""
        writer = self._writer
        if writer is None or not self._statistics.pending:
            return
        if writer.closed or writer.taken_over:  # the partition is another writer's now
            self._statistics.discard()
            return
        # ``_own`` holds the partition's durable entries from seq 0 (line i is seq i)
        self._statistics.save(writer.directory, self._own, fsync=self.fsync)

    def flush(self) -> None:
        """Block until every written record (and its Kronecker statistics) is durable."""
        if self._writer is not None:
            self._writer.flush()
            self._save_statistics()

    def close(self) -> None:
        """Flush and release the writer (the store stays readable; a later write reopens it)."""
        if self._writer is not None:
            try:
                try:
                    self._writer.flush()
                    self._save_statistics()
                finally:
                    self._writer.close()
            finally:
                if not self._writer.taken_over:  # stay refused: another manager writes now
                    index = self._writer.directory / INDEX_FILE
                    size = index.stat().st_size if index.exists() else 0
                    self._known = (self._writer.directory, (list(self._own), size))
                    self._writer = None

    def kronecker_statistics(
        self, layers: Sequence[str] | None = None, checkpoints: Sequence[int] | None = None
    ) -> StoreStatistics:
        """The K-FAC sums the store recorded at capture, and which records they cover.

        A compact store (``OffloadCallback`` defaults) records, per partition and checkpoint,
        the covariance sums of the layers it may write densely; the partitions' sums are
        merged here. A K-FAC / EK-FAC fit uses them for the covered records and reads every
        other record's factors (see ``docs/STORE_FORMAT.md``, "Kronecker statistics").

        Args:
            layers: Only these layers (default: all).
            checkpoints: Only these checkpoint labels (default: all).
        """
        layers = self.check_layers(layers)
        wanted = self.check_checkpoints(checkpoints)
        parts: dict[Path, list[tuple[int, IndexEntry]]] = {}
        for pos, (part, e) in enumerate(self.index_entries()):
            parts.setdefault(part.directory, []).append((pos, e))
        return read_statistics(list(parts.items()), layers, wanted)

    @classmethod
    def repair(cls, save_dir: str | os.PathLike) -> list[RepairReport]:
        """Rebuild the damaged indexes of a store from its shards' own headers.

        Lost, duplicated or mismatched index lines are rebuilt; shards that fail their
        recorded CRC-32, copies and unreadable shards go to ``quarantine/``; shards no line
        named are indexed from their headers (reported as unverified). Run it with no writer
        open. The rules are in ``docs/STORE_FORMAT.md`` ("Repair").

        Returns:
            One :class:`~dattri_llm.gradient.store.RepairReport` per partition.
        """
        root = Path(save_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory.")
        return [repair_partition(part) for part in discover_partitions(root)]

    def __enter__(self) -> GradientStorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ---- metadata -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(src) for _, src in self._sources) + len(self._extra)

    def __repr__(self) -> str:
        return (
            f"GradientStorageManager({str(self.save_dir)!r}, records={len(self)}, "
            f"samples={self.num_samples}, format_version={FORMAT_VERSION})"
        )

    @property
    def num_samples(self) -> int:
        """Total rows over all records (a sample seen at several steps counts each time)."""
        return int(self._column("n").sum())

    @property
    def ranks(self) -> list[int]:
        """Ranks of the partitions holding records."""
        held = [(p, src) for p, src in self._sources if len(src)] + self._extra[:1]
        return sorted({p.rank for p, _ in held})

    def fingerprint(self) -> dict[str, Any]:
        """A JSON digest of the store's content that changes whenever a record does.

        Per partition, the size and SHA-256 of every top-level file (``meta.json`` and the
        record index; hidden files such as the writer's lock are skipped), plus the record and
        row counts. A record index line carries its shard's size and CRC-32, so an appended,
        removed, repaired-differently or overwritten record changes it; the shards themselves
        are not read. What is derived from a store and kept (a ``GradientIndex``, a K-FAC fit)
        is keyed by it.

        Returns:
            ``{"records", "rows", "partitions": {relative dir: {file name: [size, sha256]}}}``.
        """
        parts: dict[str, dict[str, list]] = {}
        for part in discover_partitions(self.save_dir):
            files = {}
            for p in sorted(part.directory.iterdir()):
                if p.name.startswith(".") or not p.is_file():
                    continue
                files[p.name] = [p.stat().st_size, _file_digest(p)]
            parts[os.path.relpath(part.directory, self.save_dir)] = files
        return {"records": len(self), "rows": self.num_samples, "partitions": parts}

    def records(self) -> list[RecordInfo]:
        """Every record's location and identity, in store order."""
        return [
            RecordInfo(
                p.rank,
                e["seq"],
                e["step"],
                e["checkpoint"],
                list(e["hashes"]),
                p.directory / e["shard"],
            )
            for p, e in self.index_entries()
        ]

    def available_steps(self) -> list[int]:
        """The distinct steps in the store, ascending."""
        return [int(v) for v in np.unique(self._column("step"))]

    def available_checkpoints(self) -> list[int]:
        """The distinct checkpoint labels in the store, ascending."""
        return [int(v) for v in np.unique(self._column("checkpoint"))]

    def check_checkpoints(self, checkpoints: Sequence[int] | None) -> set[int] | None:
        """Validate a checkpoint filter against the store (``None``: no filter).

        Raises:
            KeyError: a label the store does not hold (the available ones are listed).
        """
        if checkpoints is None:
            return None
        wanted = {int(c) for c in checkpoints}
        missing = sorted(wanted - set(self.available_checkpoints()))
        if missing or not wanted:
            raise KeyError(
                f"checkpoints={sorted(wanted)}: the store {self.save_dir} holds checkpoint labels "
                f"{self.available_checkpoints()} (missing: {missing or 'none given'})."
            )
        return wanted

    def sample_hashes(self) -> list[str]:
        """Distinct sample identities in order of first occurrence (store order)."""
        return list(dict.fromkeys(h for _, e in self.index_entries() for h in e["hashes"]))

    def record_sizes(self) -> list[int]:
        """The shard bytes of every record, in store order."""
        return [int(e["bytes"]) for _, e in self.index_entries()]

    def _header(self, part: _Partition, entry: IndexEntry) -> dict:
        key = (part.rank, entry["schema"])
        if key not in self._headers:
            path = part.directory / entry["shard"]
            with self._open(part, entry, check_crc=False) as f:
                header = decode_schema(f.metadata().get(SHARD_METADATA_KEY), path)
            check_header_matches(header, entry, path)
            self._headers[key] = header
        return self._headers[key]

    def shard_header(self, index: int) -> dict:
        """The checked dattri header of record ``index``'s shard (read once per layer schema)."""
        return self._header(*self.index_entries()[index])

    @property
    def schema(self) -> list[dict]:
        """The layer schema of the first record (names, kinds, layer types, module_kwargs)."""
        ordered = self.index_entries()
        if not ordered:
            raise ValueError(f"the store {self.save_dir} holds no records yet.")
        return self._header(*ordered[0])["layers"]

    @property
    def layer_names(self) -> list[str]:
        """Layer names of the stored gradients, in capture order."""
        return [s["name"] for s in self.schema]

    @property
    def layer_types(self) -> dict[str, str]:
        """``{layer name: layer type}`` (a shared layer reports its first site's type)."""
        return {
            s["name"]: s["sites"][0]["layer_type"] if s["kind"] == "shared" else s["layer_type"]
            for s in self.schema
        }

    def last_steps(self) -> dict[int, int]:
        """``{checkpoint label: its last stored step}`` over every partition.

        Before the first write of a manager opened with ``mode="overwrite"`` this is empty: the
        records it will write follow none of the present ones.
        """
        if self.mode == "overwrite" and not self._opened:
            return {}
        ckpt, step = self._column("checkpoint"), self._column("step")
        return {int(c): int(step[ckpt == c].max()) for c in np.unique(ckpt)}

    def capture_facts(self, layers: Sequence[str] | None = None) -> CaptureFacts:
        """What the store's gradients were captured as (layers, projection, dtype, metadata).

        Read from the shard headers (every distinct layer schema is checked to describe the
        same capture); the train / test compatibility check of the attributors compares these.

        Args:
            layers: Only these layers (default: all).

        Raises:
            ValueError: the store holds no records.
            IncompatibleGradientsError: records of the store were captured incompatibly (e.g.
                a different model or projection appended to it), naming two of their shards.
        """
        ordered = self.index_entries()
        if not ordered:
            raise ValueError(f"the store {self.save_dir} holds no records yet.")
        schemas = {}  # one shard per distinct layer schema
        for part, e in ordered:
            if (part.rank, e["schema"]) not in schemas:
                path = part.directory / e["shard"]
                schemas[part.rank, e["schema"]] = (path, self._header(part, e)["layers"])
        layer_facts = merge_schema_facts(list(schemas.values()), layers, self.save_dir)
        part, e = ordered[0]
        with self._open(part, e, check_crc=False) as f:
            dtype = shard_dtype(f)
        dtype = self._header(part, e).get("storage", {}).get("capture_dtype", dtype)
        return CaptureFacts(layer_facts, dtype, _metadata(e), f"store {self.save_dir}")

    # ---- lookup ---------------------------------------------------------------------------------
    def _key(
        self, key: str | Mapping[str, Any] | torch.Tensor, hash_keys: Sequence[str] | None = None
    ) -> str:
        return key if isinstance(key, str) else hash_sample(key, keys=hash_keys)

    def locations(self, sample_hash: str) -> list[SampleLocation]:
        """Every (record, step, row) at which a sample occurs, in store order.

        See :meth:`sample_locator` for what the first lookup builds.
        """
        return self.sample_locator().locations(sample_hash)

    def lookup(
        self, inputs: Mapping[str, Any] | torch.Tensor | str, hash_keys: Sequence[str] | None = None
    ) -> list[SampleLocation]:
        """Locations of one sample given by its fields (hashed with ``hash_sample``) or hash.

        Args:
            inputs: One sample (a dict of tensors without batch axis) or its hash.
            hash_keys: Fields to hash, as in capture (default: ``input_ids`` when present).
        """
        return self.locations(self._key(inputs, hash_keys))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self.sample_locator().find(key))

    def load_sample_steps(
        self,
        sample: str | Mapping[str, Any] | torch.Tensor,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        hash_keys: Sequence[str] | None = None,
    ) -> list[GradientBlock]:
        """Every occurrence of one sample as one-row blocks, in store order.

        Raises:
            KeyError: the sample is not in the store.
        """
        h = self._key(sample, hash_keys)
        locs = self.locations(h)
        if not locs:
            raise KeyError(f"sample {h[:16]}... is not in the store {self.save_dir}.")
        layers = self.check_layers(layers)
        ordered = self.index_entries()
        out = []
        for loc in locs:
            part, e = ordered[loc.record]
            grad = self._load(part, e, layers, device, dtype, slice(loc.row, loc.row + 1))
            out.append(GradientBlock(e["step"], grad, [h], e["checkpoint"]))
        return out

    def load_sample(
        self,
        sample: str | Mapping[str, Any] | torch.Tensor,
        step: int | None = None,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        hash_keys: Sequence[str] | None = None,
    ) -> Gradient:
        """One sample's gradient (one row): its first occurrence, or the one at ``step``.

        Raises:
            KeyError: the sample is not in the store, or not at ``step``.
        """
        h = self._key(sample, hash_keys)
        locs = self.locations(h)
        if step is not None:
            at = [loc for loc in locs if loc.step == step]
            if not at:
                raise KeyError(
                    f"sample {h[:16]}... is not stored at step {step}; it is at steps "
                    f"{sorted({loc.step for loc in locs})}."
                )
            locs = at
        if not locs:
            raise KeyError(f"sample {h[:16]}... is not in the store {self.save_dir}.")
        part, e = self.index_entries()[locs[0].record]
        row = locs[0].row
        return self._load(part, e, self.check_layers(layers), device, dtype, slice(row, row + 1))

    # ---- reading --------------------------------------------------------------------------------
    def open_record(self, index: int, check_crc: bool = False) -> Any:
        """Record ``index``'s shard opened with ``safe_open`` (a context manager).

        Args:
            index: The record's position in store order.
            check_crc: Check the shard's CRC-32 (once per file and process, see ``verify``).
        """
        return self._open(*self.index_entries()[index], check_crc=check_crc)

    def _open(
        self,
        part: _Partition,
        entry: IndexEntry,
        check_crc: bool,
        device: str | torch.device = "cpu",
    ) -> Any:
        path = part.directory / entry["shard"]
        ident = identity(path, entry["crc32"]) if check_crc else None
        fresh = check_crc and not self.shard_checks.seen(path, ident)
        handle = open_shard(path, entry, fresh, device)
        if check_crc:
            self.shard_checks.add(path, ident)
        return handle

    def check_layers(self, layers: Sequence[str] | None) -> list[str] | None:
        """Validate a layer selection against the store (``None`` means every layer).

        Raises:
            KeyError: naming the unknown layers and listing the stored ones.
        """
        if layers is None:
            return None
        layers = list(layers)
        names = self.layer_names
        missing = [n for n in layers if n not in names]
        if missing:
            raise KeyError(
                f"layers {missing} are not in the store {self.save_dir} (exact stored names; "
                f"closest to {missing[0]!r}: {close_candidates(missing[0], names)}); it holds "
                f"{names}."
            )
        return layers

    def _load(
        self,
        part: _Partition,
        entry: IndexEntry,
        layers: Sequence[str] | None,
        device: str | torch.device,
        dtype: torch.dtype | None,
        rows: slice | None = None,
    ) -> Gradient:
        with self._open(part, entry, self.verify, device) as f:
            return read_gradient(f, part.directory / entry["shard"], entry, layers, dtype, rows)

    def load_record(
        self,
        index: int,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> GradientRecord:
        """Load record ``index`` (store order) as a :class:`GradientRecord`."""
        ordered = self.index_entries()
        if not -len(ordered) <= index < len(ordered):
            raise IndexError(f"record {index} out of range; the store has {len(ordered)}.")
        part, e = ordered[index]
        grad = self._load(part, e, self.check_layers(layers), device, dtype)
        return GradientRecord(e["step"], list(e["hashes"]), grad, e["checkpoint"], _metadata(e))

    def iter_blocks(
        self,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        checkpoints: Sequence[int] | None = None,
    ) -> Iterator[GradientBlock]:
        """Yield one :class:`GradientBlock` per record, in store order.

        Args:
            layers: Only these layers (default: all).
            device: Where the tensors are loaded.
            dtype: Cast floating tensors (integer index factors keep their dtype).
            checkpoints: Only records with these checkpoint labels (default: all).
        """
        layers = self.check_layers(layers)
        wanted = self.check_checkpoints(checkpoints)
        for part, e in self.index_entries():
            if wanted is not None and e["checkpoint"] not in wanted:
                continue
            grad = self._load(part, e, layers, device, dtype)
            yield GradientBlock(e["step"], grad, list(e["hashes"]), e["checkpoint"], _metadata(e))

    def __iter__(self) -> Iterator[GradientBlock]:
        return self.iter_blocks()

    def verify_all(self) -> int:
        """Check every shard (size, CRC-32, header vs index line); return the number checked.

        Raises:
            StoreFormatError: naming the first bad file.
        """
        ordered = self.index_entries()
        self.shard_checks.clear()
        for part, e in ordered:
            path = part.directory / e["shard"]
            with self._open(part, e, check_crc=True) as f:
                header = decode_schema(f.metadata().get(SHARD_METADATA_KEY), path)
            check_header_matches(header, e, path)
        return len(ordered)
