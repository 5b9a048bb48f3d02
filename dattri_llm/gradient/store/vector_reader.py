"""Contiguous blocks of rows from a store whose layers are fixed-size vectors.

A projected store (``dense`` / ``mask`` / ``sparse`` projections, ``logra`` written as its dense
projected gradient, any materialized layer) holds, per record and layer, one ``(n, d)`` tensor.
Scoring such a store is a matrix product, so the reader's job is to hand the score loop large
contiguous ``(rows, d)`` blocks at the speed of a sequential read. :class:`VectorBlockReader`
reads each shard's tensors with one scatter read (``os.preadv``) straight into preallocated
per-layer buffers (one ``(capacity, d)`` tensor per layer and buffer slot, reused block after
block): no ``Gradient`` per record,
no per-row Python object, one copy from the page cache.

The checks are those of the general reader (``shard.py``), on the same bytes: the shard's size
against its index line, its CRC-32 the first time the manager reads it (computed over the bytes
as they are read, so verifying costs no second pass), its dattri header against the line
(``check_header_matches``), and every tensor read has the shape ``(n, d)`` and a floating dtype.
A failure raises :class:`~dattri_llm.gradient.store.format.StoreFormatError` naming the shard.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dattri_llm.gradient.store.format import (
    SHARD_METADATA_KEY,
    StoreFormatError,
    check_header,
    decode_json,
    decode_schema,
    resolve_tables,
)
from dattri_llm.gradient.store.shard import capture_dtype, check_header_matches
from dattri_llm.gradient.store.verified import identity

__all__ = [
    "VectorLayer",
    "VectorBlock",
    "VectorBlockReader",
    "vector_layers",
    "store_vector_layers",
    "record_widths",
    "read_ahead",
]

#: safetensors dtype names -> torch dtypes (the floating ones a gradient can be stored in).
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


@dataclass(frozen=True)
class VectorLayer:
    """One selected layer of a vector store: its position in the schema and its width."""

    name: str
    position: int
    layer_type: str
    module_kwargs: dict


def vector_layers(schema: Sequence[dict], layers: Sequence[str] | None) -> list[VectorLayer] | None:
    """The selected layers of a shard schema when each is one plain materialized tensor.

    Returns:
        The layers in ``layers`` order (schema order when ``None``), or ``None`` when one of
        them is factorized or shared (the general reader handles those).
    """
    specs = {spec["name"]: (i, spec) for i, spec in enumerate(schema)}
    names = list(layers) if layers is not None else [s["name"] for s in schema]
    out = []
    for name in names:
        if name not in specs:
            return None
        i, spec = specs[name]
        if spec["kind"] != "materialized":
            return None
        out.append(VectorLayer(name, i, spec["layer_type"], decode_json(spec["module_kwargs"])))
    return out


def store_vector_layers(
    store: Any, records: Sequence[int], layers: Sequence[str] | None
) -> list[VectorLayer] | None:
    """:func:`vector_layers` over every distinct schema of the chosen records of a store.

    Returns:
        The layers when they are plain materialized tensors of the same type and
        hyper-parameters in every schema, else ``None`` (the general reader's case).
    """
    ordered = store.index_entries()
    seen: set[tuple[int, str]] = set()
    first: list[VectorLayer] | None = None
    for pos in records:
        part, entry = ordered[pos]
        key = (part.rank, entry["schema"])
        if key in seen:
            continue
        seen.add(key)
        found = vector_layers(store.shard_header(pos)["layers"], layers)
        if found is None:
            return None
        if first is None:
            first = found
        elif [(v.name, v.layer_type, v.module_kwargs) for v in found] != [
            (v.name, v.layer_type, v.module_kwargs) for v in first
        ]:
            return None
    return first


def record_widths(store: Any, record: int, layers: Sequence[VectorLayer]) -> dict[str, int]:
    """``{layer name: numbers per sample}`` of the selected layers, read from one record's shard.

    Args:
        store: The ``GradientStorageManager``.
        record: The record's position in store order.
        layers: The layers (as :func:`store_vector_layers` returns them).
    """
    with store.open_record(record) as f:
        return {v.name: int(f.get_slice(f"{v.position}.data").get_shape()[1]) for v in layers}


@dataclass
class VectorBlock:
    """Consecutive records of one checkpoint read as per-layer ``(rows, d)`` tensors.

    The tensors are views of the reader's buffers: valid until the next block is read.

    Attributes:
        layers: ``{name: (rows, d)}`` in the dtype the general reader returns (the capture
            dtype of a record stored narrower, or the reader's ``dtype``).
        records: The records' positions in the order the reader was given.
        hashes / steps / checkpoints: One entry per row.
        metadata: Per record, its ``GradientRecord.metadata`` (decoded).
        record_steps: Per record, its step.
    """

    layers: dict[str, torch.Tensor]
    records: list[int]
    hashes: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)
    metadata: list[dict] = field(default_factory=list)
    record_steps: list[int] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        """Rows in the block."""
        return len(self.hashes)


class VectorBlockReader:
    """Read chosen records of a vector store as contiguous per-layer blocks.

    Args:
        store: The ``GradientStorageManager``.
        layers: The selected layers (all schema layers materialized: see :func:`vector_layers`).
        dtype: Cast the blocks to this dtype (``None``: as the general reader, the capture
            dtype of a record stored in a narrower one).
        block_rows: Rows per block (a larger record is one block of its own).
        slots: Sets of buffers used in turn: a block stays valid while the next ``slots - 1``
            are read (3 lets a thread read ahead, see :func:`read_ahead`).
    """

    def __init__(
        self,
        store: Any,
        layers: Sequence[VectorLayer],
        dtype: torch.dtype | None = None,
        block_rows: int = 8192,
        slots: int = 1,
    ) -> None:
        self.store = store
        self.layers = list(layers)
        self.dtype = dtype
        self.block_rows = max(1, int(block_rows))
        self.slots = max(1, int(slots))
        self._slot = 0
        self._buffers: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}
        self._widths: dict[str, int] = {}
        self._scratch: dict[int, bytearray] = {}
        self._schemas: dict[str, list] = {}  # schema digest -> its validated layers
        self.bytes_read = 0

    # ---- buffers --------------------------------------------------------------------------------
    def _buffer(self, name: str, dtype: torch.dtype, row0: int, rows: int, width: int):
        """The layer's buffer with room for ``rows`` rows (the first ``row0`` kept)."""
        key = (name, dtype, self._slot)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows or buf.shape[1] != width:
            new = torch.empty(max(rows, self.block_rows), width, dtype=dtype)
            if row0 and buf is not None:
                new[:row0] = buf[:row0]
            self._buffers[key] = buf = new
        return buf

    def _spare(self, slot: int, nbytes: int) -> memoryview:
        """Scratch bytes for a tensor that is read but not kept (one buffer per position)."""
        buf = self._scratch.get(slot)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch[slot] = bytearray(nbytes)
        return memoryview(buf)[:nbytes]

    # ---- one shard ------------------------------------------------------------------------------
    def _header(self, raw: str | None, entry: dict, path: Path) -> dict:
        """The shard's checked header (its layer schema validated once per distinct schema)."""
        known = self._schemas.get(entry["schema"])
        if known is not None and raw is not None:
            try:
                header = json.loads(raw)
            except json.JSONDecodeError as e:
                raise StoreFormatError(f"shard {path} has a corrupted header: {e}") from None
            layers = header.get("layers") if isinstance(header, dict) else None
            # the schema by its table's digest (version 3; the table was read and hashed when
            # the schema became known) or inline and equal
            if layers == entry["schema"] or layers == known:
                header["layers"] = known
                resolve_tables(header, path)  # a storage choices table
                _check_fields(header, path)
                check_header_matches(header, entry, path, fingerprint=entry["schema"])
                return header
        header = decode_schema(raw, path)
        check_header_matches(header, entry, path)
        self._schemas[entry["schema"]] = header["layers"]
        return header

    def _read_shard(
        self,
        part: Any,
        entry: dict,
        row0: int,
        stored: torch.dtype | None,
        capture: torch.dtype | None,
    ) -> tuple[torch.dtype, dict, torch.dtype | None]:
        """Read one shard's selected tensors into the buffers at row ``row0``.

        Returns:
            ``(stored dtype, header, capture dtype or None)``.
        """
        path = part.directory / entry["shard"]
        store = self.store
        n = int(entry["n"])
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise StoreFormatError(
                f"shard {path} is missing although its partition's index lists it."
            ) from None
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            ident = identity(path, entry["crc32"], st) if store.verify else None
            check_crc = bool(store.verify) and not store.shard_checks.seen(path, ident)
            if size != entry["bytes"]:
                raise StoreFormatError(
                    f"shard {path} is truncated or corrupted: {size} bytes, the index recorded "
                    f"{entry['bytes']}."
                )
            head = f.read(8)
            if len(head) != 8:
                raise StoreFormatError(f"shard {path} is corrupted: no safetensors header.")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8:
                raise StoreFormatError(f"shard {path} is corrupted: header length {hlen}.")
            raw = f.read(hlen)
            crc = zlib.crc32(raw, zlib.crc32(head)) if check_crc else 0
            try:
                table = json.loads(raw)
                metadata = table.pop("__metadata__", None) or {}
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise StoreFormatError(f"shard {path} is corrupted: {e}") from None
            header = self._header(metadata.get(SHARD_METADATA_KEY), entry, path)
            captured = capture_dtype(header, path)
            if row0 and captured != capture:
                raise _Mixed(stored, -1)
            wanted = {}
            for layer in self.layers:
                key = f"{layer.position}.data"
                spec = (
                    header["layers"][layer.position]
                    if layer.position < len(header["layers"])
                    else None
                )
                info = table.get(key)
                if spec is None or spec.get("name") != layer.name or not isinstance(info, dict):
                    raise StoreFormatError(
                        f"shard {path} is corrupted: layer {layer.name!r} has no tensor {key!r}."
                    )
                dt = _DTYPES.get(info.get("dtype"))
                shape = info.get("shape")
                if dt is None or not isinstance(shape, list) or len(shape) != 2 or shape[0] != n:
                    raise StoreFormatError(
                        f"shard {path} is corrupted: tensor {key!r} has dtype "
                        f"{info.get('dtype')} and shape {shape} for {n} samples."
                    )
                if stored is None:
                    stored = dt
                width = self._widths.setdefault(layer.name, int(shape[1]))
                if dt != stored or shape[1] != width:
                    raise _Mixed(dt, int(shape[1]))
                wanted[key] = layer
            data0 = 8 + hlen
            spans = []
            for key, info in table.items():
                offsets = info.get("data_offsets") if isinstance(info, dict) else None
                if not isinstance(offsets, list) or len(offsets) != 2:
                    raise StoreFormatError(f"shard {path} is corrupted: tensor {key!r} offsets.")
                spans.append((int(offsets[0]), int(offsets[1]), key))
            spans.sort()
            pos = 0
            views: list[memoryview] = []  # the data region in file order, read in one preadv
            for begin, end, key in spans:
                if begin != pos or end < begin or data0 + end > size:
                    raise StoreFormatError(
                        f"shard {path} is corrupted: tensor {key!r} spans bytes {begin}..{end}."
                    )
                layer = wanted.get(key)
                if layer is not None:
                    width = self._widths[layer.name]
                    buf = self._buffer(layer.name, stored, row0, row0 + n, width)
                    rows = buf[row0 : row0 + n]
                    if end - begin != rows.numel() * rows.element_size():
                        raise StoreFormatError(
                            f"shard {path} is corrupted: tensor {key!r} holds {end - begin} bytes."
                        )
                    views.append(memoryview(rows.view(torch.uint8).numpy()).cast("B"))
                elif end > begin:  # a layer not selected: read too (CRC-32, one read)
                    views.append(self._spare(len(views), end - begin))
                pos = end
            got = os.preadv(f.fileno(), views, data0) if views else 0
            if got != pos:
                raise StoreFormatError(
                    f"shard {path} is truncated: it ended while its tensors were read."
                )
            if check_crc:
                for view in views:
                    crc = zlib.crc32(view, crc)
            if data0 + pos != size:
                raise StoreFormatError(
                    f"shard {path} is corrupted: {size - data0 - pos} stray bytes."
                )
        if check_crc:
            if crc != entry["crc32"]:
                raise StoreFormatError(
                    f"shard {path} is corrupted: its CRC-32 does not match the index."
                )
            store.shard_checks.add(path, ident)
        self.bytes_read += size
        assert stored is not None
        return stored, header, captured

    # ---- blocks ---------------------------------------------------------------------------------
    def blocks(self, records: Sequence[int]) -> Iterator[VectorBlock]:
        """Yield the records (store-order positions) as blocks, in the given order.

        A block holds consecutive records of one checkpoint label and one stored dtype.
        """
        ordered = self.store.index_entries()
        pending: list[int] = []
        state: dict[str, Any] = {"stored": None, "capture": None, "ckpt": None, "rows": 0}
        block = VectorBlock({}, [])
        for pos in records:
            part, entry = ordered[pos]
            n = int(entry["n"])
            ckpt = int(entry["checkpoint"])
            full = state["rows"] and state["rows"] + n > self.block_rows
            if pending and (full or ckpt != state["ckpt"]):
                yield self._finish(block, state)
                pending, block = [], VectorBlock({}, [])
                state.update(stored=None, capture=None, rows=0)
            for _ in range(2):  # at most once more, after a dtype / width change
                try:
                    stored, header, capture = self._read_shard(
                        part, entry, state["rows"], state["stored"], state["capture"]
                    )
                    break
                except _Mixed:
                    if pending:
                        yield self._finish(block, state)
                        pending, block = [], VectorBlock({}, [])
                    state.update(stored=None, capture=None, rows=0)
                    for layer in self.layers:
                        self._widths.pop(layer.name, None)
            else:  # pragma: no cover - a second change within one record is a corrupted shard
                raise StoreFormatError(f"shard {part.directory / entry['shard']} is corrupted.")
            state.update(stored=stored, capture=capture, ckpt=ckpt)
            pending.append(pos)
            block.records.append(pos)
            block.hashes += entry["hashes"]
            block.steps += [int(entry["step"])] * n
            block.checkpoints += [ckpt] * n
            block.metadata.append(decode_json(entry.get("metadata", {})))
            block.record_steps.append(int(entry["step"]))
            state["rows"] += n
        if pending:
            yield self._finish(block, state)

    def _finish(self, block: VectorBlock, state: dict) -> VectorBlock:
        """The block's views of the current slot's buffers; the next block uses the next slot."""
        out = self._views(block, state)
        self._slot = (self._slot + 1) % self.slots
        return out

    def _views(self, block: VectorBlock, state: dict) -> VectorBlock:
        rows, stored = state["rows"], state["stored"]
        out_dtype = self.dtype if self.dtype is not None else state["capture"]
        for layer in self.layers:
            view = self._buffers[(layer.name, stored, self._slot)][:rows]
            block.layers[layer.name] = view if out_dtype in (None, stored) else view.to(out_dtype)
        return block


def read_ahead(blocks: Iterator[VectorBlock], depth: int = 1) -> Iterator[VectorBlock]:
    """Yield ``blocks`` while a thread reads the next ones.

    File reads and CRC-32 release the GIL, so they overlap the consumer's products. Give it a
    reader with ``slots >= depth + 2``: one block being used, ``depth`` queued, one being read.
    An error of the reader is raised in the consumer.
    """
    done = object()
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for block in blocks:
                if not put(block):
                    return
            put(done)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(e)

    thread = threading.Thread(target=produce, name="dattri-vector-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = out.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _check_fields(header: dict, path: Path) -> None:
    """``check_header`` for a header whose layers were checked before (an equal schema).

    The items of ``hashes`` are not type-checked here: ``check_header_matches`` then requires
    them equal to the index line's, which are strings.
    """
    ok = all(
        isinstance(header.get(k), int) and not isinstance(header.get(k), bool)
        for k in ("step", "checkpoint")
    ) and isinstance(header.get("hashes"), list)
    ok = ok and all(
        isinstance(header[k], dict) for k in ("metadata", "extra", "storage") if k in header
    )
    if not ok:
        check_header(header, path)  # raises, naming the field


class _Mixed(Exception):
    """A record stored in another dtype or width than the block it would join."""

    def __init__(self, dtype: torch.dtype, width: int) -> None:
        super().__init__(f"{dtype} x {width}")
        self.dtype = dtype
        self.width = width
