"""The on-disk format of a gradient store: constants, ``meta.json``, and Gradient <-> shard.

One record is one safetensors file (a *shard*). Its tensors are named by layer position:
``"{i}.a"`` / ``"{i}.g"`` (factorised), ``"{i}.data"`` (materialised), ``"{i}.{j}.a"`` ... (site
``j`` of a shared layer). Its ``__metadata__`` holds one JSON string under
:data:`SHARD_METADATA_KEY` with the record's step, checkpoint and hashes and its layer schema
(names, kinds, layer types, ``module_kwargs``): inline up to version 2; from version 3 the
digest of a *layer table*, a file of the partition written once per distinct schema
(:data:`TABLE_DIR`), because the schema is the same in every record and outweighs a small
record's numbers. The index records each shard's size and :func:`file_crc32`. The full
specification is ``docs/STORE_FORMAT.md``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    LayerGradient,
    Materialized,
    Shared,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_FILE",
    "INDEX_FILE",
    "SHARD_DIR",
    "SHARD_METADATA_KEY",
    "KRONECKER_FILE",
    "TABLE_DIR",
    "StoreFormatError",
    "LayerTableError",
    "read_meta",
    "write_meta",
    "encode_record",
    "decode_schema",
    "check_header",
    "decode_gradient",
    "tensor_keys",
    "schema_fingerprint",
    "encode_json",
    "decode_json",
    "file_crc32",
    "uses_tables",
    "table_blob",
    "read_table",
    "resolve_tables",
    "header_fingerprint",
]

#: The format name written into ``meta.json``; readers refuse anything else.
FORMAT_NAME = "dattri_llm.gradient_store"
#: The format version this code writes and the newest it reads (1: the JSONL index only; 2: with
#: the binary record and sample index, ``binary_index.py``; 3: shard headers refer to layer
#: tables instead of holding the layer schema).
FORMAT_VERSION = 3
META_FILE = "meta.json"
INDEX_FILE = "index.jsonl"
SHARD_DIR = "shards"
SHARD_METADATA_KEY = "dattri_llm"
#: A partition's Kronecker statistics (``kronecker_stats.py``), beside its index.
KRONECKER_FILE = "kronecker_statistics.safetensors"
#: A partition's layer tables (version 3): ``<digest>.json``, one per distinct value.
TABLE_DIR = "schemas"


class StoreFormatError(ValueError):
    """A file of a gradient store is missing, corrupted or of an unsupported format."""


class LayerTableError(StoreFormatError):
    """A partition's layer table is missing or corrupted (its shards cannot be decoded)."""


# ---- JSON with exact round trips of the values module_kwargs hold ---------------------------
def encode_json(obj: Any, where: str = "module_kwargs") -> Any:
    """Make ``obj`` JSON-safe while keeping tuples, dtypes and sizes distinguishable.

    Raises:
        TypeError: for a value that cannot be stored, naming where it was found.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} is not a string; the store keeps JSON keys.")
            out[k] = encode_json(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, list):
        return [encode_json(v, where) for v in obj]
    if isinstance(obj, torch.Size):
        return {"__size__": [int(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"__tuple__": [encode_json(v, where) for v in obj]}
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"{where}: value {obj!r} of type {type(obj).__name__} cannot be stored; module_kwargs "
        "must hold JSON values (numbers, strings, bools, None, lists, tuples, dicts)."
    )


def decode_json(obj: Any) -> Any:
    """Inverse of :func:`encode_json`.

    Raises:
        ValueError: a tagged value that is malformed (a corrupted store).
    """
    if isinstance(obj, list):
        return [decode_json(v) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            ((key, val),) = obj.items()
            if key == "__tuple__" and isinstance(val, list):
                return tuple(decode_json(v) for v in val)
            if key == "__size__" and isinstance(val, list):
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in val):
                    raise ValueError(f"malformed torch.Size {val!r}")
                return torch.Size(val)
            if key == "__dtype__":
                dtype = getattr(torch, val, None) if isinstance(val, str) else None
                if not isinstance(dtype, torch.dtype):
                    raise ValueError(f"unknown dtype {val!r}")
                return dtype
            if key in ("__tuple__", "__size__"):
                raise ValueError(f"malformed {key} value {val!r}")
        return {k: decode_json(v) for k, v in obj.items()}
    return obj


# ---- meta.json -------------------------------------------------------------------------------
def write_meta(directory: Path, extra: dict | None = None) -> None:
    """Write ``meta.json`` atomically (temp file, fsync, rename) unless it exists."""
    path = directory / META_FILE
    if path.exists():
        return
    meta = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **(extra or {})}
    tmp = directory / f".{META_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# other dattri_llm directories a user may pass where a gradient store is expected -> the way on
_OTHER_FORMATS = {
    "dattri_llm.trajectory": (
        " It is a TrajectorySnapshots directory (parameters and batches of a run): pass "
        "ReplayGradientSource(model, TrajectorySnapshots(dir), loss_fn) as the train source "
        "instead, which recomputes each step's per-sample gradients from it."
    ),
}


def read_meta(directory: Path) -> dict:
    """Read and check ``meta.json``.

    Raises:
        StoreFormatError: when it is missing, not JSON, of another format, or of a newer
            version than this code reads.
    """
    path = directory / META_FILE
    if not path.is_file():
        raise StoreFormatError(
            f"{directory} is not a gradient store: it has no {META_FILE}. Pass the directory a "
            "GradientStorageManager wrote (its save_dir)."
        )
    try:
        meta = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{path} is corrupted (not valid UTF-8 JSON): {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else meta
        hint = _OTHER_FORMATS.get(found, "") if isinstance(found, str) else ""
        raise StoreFormatError(
            f"{path} describes format {found!r}, expected {FORMAT_NAME!r}: this directory is not "
            f"a dattri_llm gradient store.{hint}"
        )
    version = meta.get("version")
    if not isinstance(version, int) or version < 1 or version > FORMAT_VERSION:
        raise StoreFormatError(
            f"{path} has format version {version!r}; this dattri_llm reads versions 1.."
            f"{FORMAT_VERSION}. Upgrade dattri_llm to read it."
        )
    for key, low in (("rank", 0), ("world_size", 1)):
        value = meta.get(key, low)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise StoreFormatError(
                f"{path} is corrupted: {key!r} must be an integer >= {low}, got {value!r}."
            )
    return meta


# ---- Gradient <-> tensors + schema -----------------------------------------------------------
def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _leaf_schema(lg: Factorized | Materialized, where: str) -> dict:
    kind = "factorized" if isinstance(lg, Factorized) else "materialized"
    return {
        "kind": kind,
        "layer_type": lg.layer_type,
        "module_kwargs": encode_json(dict(lg.module_kwargs), f"{where}.module_kwargs"),
    }


def _leaf_tensors(lg: Factorized | Materialized, prefix: str) -> dict[str, torch.Tensor]:
    if isinstance(lg, Factorized):
        return {f"{prefix}.a": _cpu(lg.a), f"{prefix}.g": _cpu(lg.g)}
    if isinstance(lg, Materialized):
        return {f"{prefix}.data": _cpu(lg.data)}
    raise TypeError(f"cannot store a layer gradient of type {type(lg).__name__}")


def _unalias(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Clone tensors that share storage or view a larger one (safetensors refuses those)."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[k] = t
    return out


def encode_record(record: GradientRecord) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a record into safetensors tensors (on CPU, contiguous) and its JSON header.

    Returns:
        ``(tensors, header)``; ``header`` = ``{"layers": schema, "step", "checkpoint",
        "hashes"}`` and ``"metadata"`` when the record carries any.
    """
    n = record.gradient.batch_size
    if len(record.hashes) != n:
        raise ValueError(
            f"record at step {record.step} has {len(record.hashes)} hashes for {n} samples; "
            "each sample needs exactly one hash."
        )
    schema: list[dict] = []
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, lg) in enumerate(record.gradient.layers.items()):
        if isinstance(lg, Shared):
            sites = []
            for j, site in enumerate(lg.sites):
                sites.append(_leaf_schema(site, f"layer {name!r} site {j}"))
                tensors.update(_leaf_tensors(site, f"{i}.{j}"))
            schema.append(
                {"name": name, "kind": "shared", "site_names": list(lg.site_names), "sites": sites}
            )
        else:
            schema.append({"name": name, **_leaf_schema(lg, f"layer {name!r}")})
            tensors.update(_leaf_tensors(lg, str(i)))
    header = {
        "layers": schema,
        "step": int(record.step),
        "checkpoint": int(record.checkpoint),
        "hashes": [str(h) for h in record.hashes],
    }
    if record.metadata:
        header["metadata"] = encode_json(
            dict(record.metadata), f"record metadata at step {record.step}"
        )
    return _unalias(tensors), header


def table_blob(value: Any) -> bytes:
    """The canonical JSON bytes of a layer schema (or other table value): a table file's body."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def schema_fingerprint(schema: Any) -> str:
    """A short digest of a layer schema (records with equal schemas share it).

    It is also the name of the schema's layer table: the first 16 hex digits of the SHA-256
    of :func:`table_blob`.
    """
    return hashlib.sha256(table_blob(schema)).hexdigest()[:16]


# ---- layer tables (version 3) ----------------------------------------------------------------
def uses_tables(meta: dict) -> bool:
    """Whether a partition (its ``meta.json``) writes layer tables (format version >= 3)."""
    return int(meta.get("version", 1)) >= 3


_DIGEST = re.compile(r"[0-9a-f]{16}")
#: Tables read by this process: path -> (file identity, value). A table is immutable (its name
#: is its content's digest), so a file is read and hashed once, and again only when replaced.
_TABLES: dict[str, tuple[tuple[int, ...], Any]] = {}


def read_table(directory: Path, digest: Any, shard: Path) -> Any:
    """The value of the partition ``directory``'s layer table ``digest`` (checked, cached).

    Raises:
        StoreFormatError: naming ``shard`` and the table when the digest is malformed, the
            table is missing, or its bytes do not hash to its name (a corrupted table).
    """
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise StoreFormatError(f"shard {shard} has a corrupted header: table digest {digest!r}.")
    path = directory / TABLE_DIR / f"{digest}.json"
    try:
        st = os.stat(path)
    except OSError:
        raise LayerTableError(
            f"shard {shard} refers to the layer table {path}, which is missing: a partition's "
            f"{TABLE_DIR}/ directory belongs to it (copy or restore it with the shards)."
        ) from None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _TABLES.get(str(path))
    if hit is not None and hit[0] == ident:
        return hit[1]
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest()[:16] != digest:
        raise LayerTableError(
            f"layer table {path} is corrupted: its bytes do not have the SHA-256 its name gives "
            "(the shards that refer to it cannot be read; restore the file)."
        )
    value = json.loads(raw)  # hashed bytes a writer produced with json.dumps
    _TABLES[str(path)] = (ident, value)
    return value


def resolve_tables(header: dict, path: Path) -> dict:
    """Replace a version-3 header's table digests by the tables (layers, storage choices).

    Adds ``"schema"``: the layer schema's digest (the index line's ``schema``), known without
    hashing the schema again when it came from a table; an inline (version 1 / 2) header gets
    it computed on demand by :func:`header_fingerprint` instead.
    """
    header.pop("schema", None)  # never taken from the file
    if isinstance(header.get("layers"), str):
        digest = header["layers"]
        header["layers"] = read_table(path.parent.parent, digest, path)
        header["schema"] = digest
    storage = header.get("storage")
    if isinstance(storage, dict) and isinstance(storage.get("layers"), str):
        choices = read_table(path.parent.parent, storage["layers"], path)
        if not isinstance(choices, dict):
            raise StoreFormatError(f"shard {path} has a corrupted header: storage layers.")
        header["storage"] = {**storage, "layers": choices}
    return header


def header_fingerprint(header: dict) -> str:
    """The digest of a decoded header's layer schema (from its table, or hashed)."""
    return header.get("schema") or schema_fingerprint(header["layers"])


def decode_schema(raw: str | None, path: Path) -> dict:
    """Parse and check a shard's JSON header, naming ``path`` when it is unreadable.

    A version-3 header's layer tables are read from the shard's partition (the directory
    above ``shards/``) and put in place, so callers see the layer schema in every version.
    """
    try:
        header = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError as e:
        raise StoreFormatError(f"shard {path} has a corrupted header: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("layers"), (list, str)):
        raise StoreFormatError(
            f"shard {path} has no dattri_llm header (metadata key {SHARD_METADATA_KEY!r}); it "
            "was not written by GradientStorageManager or is corrupted."
        )
    return check_header(resolve_tables(header, path), path)


def _check_leaf(spec: Any, where: str) -> None:
    if not isinstance(spec, dict) or spec.get("kind") not in ("factorized", "materialized"):
        raise ValueError(f"{where} has no valid 'kind'")
    if not isinstance(spec.get("layer_type"), str):
        raise ValueError(f"{where} has no valid 'layer_type'")
    if not isinstance(spec.get("module_kwargs"), dict):
        raise ValueError(f"{where} has no valid 'module_kwargs'")
    decode_json(spec["module_kwargs"])


def check_header(header: dict, path: Path) -> dict:
    """Check the structure of a shard header (layers, step, checkpoint, hashes, metadata).

    Raises:
        StoreFormatError: naming ``path`` and the first malformed field.
    """
    try:
        names = set()
        for i, spec in enumerate(header["layers"]):
            where = f"layer {i}"
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError(f"{where} has no valid 'name'")
            if spec["name"] in names:
                raise ValueError(f"layer {spec['name']!r} appears twice")
            names.add(spec["name"])
            if spec.get("kind") == "shared":
                sites, site_names = spec.get("sites"), spec.get("site_names")
                if (
                    not isinstance(sites, list)
                    or not isinstance(site_names, list)
                    or not sites
                    or len(sites) != len(site_names)
                    or not all(isinstance(n, str) for n in site_names)
                ):
                    raise ValueError(f"shared {where} has no valid 'sites' / 'site_names'")
                for j, site in enumerate(sites):
                    _check_leaf(site, f"{where} site {j}")
            else:
                _check_leaf(spec, where)
        for key in ("step", "checkpoint"):
            if not isinstance(header.get(key), int) or isinstance(header.get(key), bool):
                raise ValueError(f"no valid {key!r}")
        hashes = header.get("hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
            raise ValueError("no valid 'hashes'")
        for key in ("metadata", "extra", "storage"):
            if key in header and not isinstance(header[key], dict):
                raise ValueError(f"{key!r} is not an object")
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise StoreFormatError(f"shard {path} has a corrupted header: {e}.") from None
    return header


def tensor_keys(schema: Sequence[dict], layers: Sequence[str] | None = None) -> list[str]:
    """The shard keys holding the given layers (all layers by default)."""
    keys: list[str] = []
    for i, spec in enumerate(schema):
        if layers is not None and spec["name"] not in layers:
            continue
        if spec["kind"] == "shared":
            for j, site in enumerate(spec["sites"]):
                keys += _leaf_keys(site, f"{i}.{j}")
        else:
            keys += _leaf_keys(spec, str(i))
    return keys


def _leaf_keys(spec: dict, prefix: str) -> list[str]:
    return [f"{prefix}.a", f"{prefix}.g"] if spec["kind"] == "factorized" else [f"{prefix}.data"]


def _leaf(spec: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> LayerGradient:
    kw = decode_json(spec["module_kwargs"])
    if spec["kind"] == "factorized":
        return Factorized(tensors[f"{prefix}.a"], tensors[f"{prefix}.g"], spec["layer_type"], kw)
    if spec["kind"] == "materialized":
        return Materialized(tensors[f"{prefix}.data"], spec["layer_type"], kw)
    raise StoreFormatError(f"unknown layer kind {spec['kind']!r} in a shard header")


def decode_gradient(
    schema: Sequence[dict], tensors: dict[str, torch.Tensor], layers: Sequence[str] | None = None
) -> Gradient:
    """Rebuild the :class:`Gradient` of the selected layers (schema order) from shard tensors."""
    out: dict[str, LayerGradient] = {}
    for i, spec in enumerate(schema):
        if layers is not None and spec["name"] not in layers:
            continue
        if spec["kind"] == "shared":
            sites = [_leaf(s, f"{i}.{j}", tensors) for j, s in enumerate(spec["sites"])]
            out[spec["name"]] = Shared(sites, list(spec["site_names"]))
        else:
            out[spec["name"]] = _leaf(spec, str(i), tensors)
    return Gradient(out)


def file_crc32(path: Path) -> int:
    """CRC-32 of a whole file (memory-mapped, no copy)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return zlib.crc32(mm)
