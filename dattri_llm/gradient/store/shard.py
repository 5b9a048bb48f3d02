"""Reading one shard against its index line: size, CRC-32, header, tensors.

Every field the shard header and the index line both hold must agree (``step``,
``checkpoint``, ``hashes`` and so ``n``, ``metadata``, ``extra``, the schema digest), and every
tensor read must have one row per sample; anything else is a :class:`StoreFormatError` naming
the shard (``docs/STORE_FORMAT.md``, "What the reader verifies").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dattri_llm.gradient.compat import (
    CaptureFacts,
    IncompatibleGradientsError,
    LayerFacts,
    compare_facts,
)
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.store.format import (
    SHARD_METADATA_KEY,
    StoreFormatError,
    decode_gradient,
    decode_json,
    decode_schema,
    file_crc32,
    header_fingerprint,
    tensor_keys,
)
from dattri_llm.gradient.store.index import IndexEntry

__all__ = [
    "capture_dtype",
    "open_shard",
    "check_header_matches",
    "read_gradient",
    "schema_facts",
    "merge_schema_facts",
    "shard_dtype",
]


def open_shard(
    path: Path, entry: IndexEntry, check_crc: bool, device: str | torch.device = "cpu"
) -> Any:
    """Open a shard (a ``safe_open`` handle) after checking its size (and CRC-32).

    Raises:
        StoreFormatError: the shard is missing, of another size or CRC-32, or unreadable.
    """
    if not path.is_file():
        raise StoreFormatError(f"shard {path} is missing although its partition's index lists it.")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise StoreFormatError(
            f"shard {path} is truncated or corrupted: {size} bytes, the index recorded "
            f"{entry['bytes']}."
        )
    if check_crc and file_crc32(path) != entry["crc32"]:
        raise StoreFormatError(f"shard {path} is corrupted: its CRC-32 does not match the index.")
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise StoreFormatError(f"shard {path} is corrupted: {e}") from None


#: Index fields that the shard header holds too (under the same key).
_SHARED_FIELDS = ("step", "checkpoint", "hashes", "metadata", "extra")


def check_header_matches(
    header: dict, entry: IndexEntry, path: Path, fingerprint: str | None = None
) -> None:
    """Refuse a shard whose header disagrees with its index line on any field both hold.

    ``fingerprint``: the header's schema digest when the caller already computed it.
    """
    diff = [k for k in _SHARED_FIELDS if header.get(k) != entry.get(k)]
    if len(header["hashes"]) != entry["n"]:
        diff.append("n")
    if (fingerprint or header_fingerprint(header)) != entry["schema"]:
        diff.append("schema")
    if diff:
        shown = "; ".join(
            f"{k}: index {entry.get(k)!r} vs shard {header.get(k)!r}"
            for k in diff
            if k in _SHARED_FIELDS and k != "hashes"
        )
        raise StoreFormatError(
            f"shard {path} does not hold the record its index line describes ({', '.join(diff)} "
            f"differ{': ' + shown if shown else ''}); the store is corrupted. The shard's own "
            "header is authoritative when its CRC-32 matches: GradientStorageManager.repair("
            "save_dir) rebuilds the index from the headers."
        )


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def shard_dtype(f: Any) -> str | None:
    """The floating dtype of an open shard's gradients (``"float32"``, ...)."""
    keys = [k for k in f.keys() if not k.endswith(".a")]  # ".a" may be integer indices
    return _DTYPES.get(f.get_slice(keys[0]).get_dtype()) if keys else None


def merge_schema_facts(
    schemas: list[tuple[Path, list[dict]]], layers: Sequence[str] | None, store: Path
) -> dict[str, LayerFacts]:
    """The layer facts of a store's distinct layer schemas, which must describe one capture.

    Args:
        schemas: ``(shard, layer schema)`` of one shard per distinct schema, in store order.
        layers: Only these layers (default: all).
        store: The store directory (for the error).

    Raises:
        IncompatibleGradientsError: two schemas differ beyond factors vs dense, naming both
            shards.
    """
    first_path, first = schemas[0][0], schema_facts(schemas[0][1], layers)
    for path, schema in schemas[1:]:
        diffs = compare_facts(
            first, schema_facts(schema, layers), names=(first_path.name, path.name)
        )
        if diffs:
            raise IncompatibleGradientsError(
                f"the store {store} mixes incompatible captures (shards {first_path} and "
                f"{path}):\n  - " + "\n  - ".join(diffs) + "\nWrite each capture to its own "
                "store (GradientStorageManager(..., mode='create'))."
            )
    return dict(first.layers)


def schema_facts(schema: list[dict], layers: Sequence[str] | None) -> CaptureFacts:
    """The :class:`CaptureFacts` layers of a shard's layer schema (only ``layers`` if given)."""
    out = {}
    for spec in schema:
        if layers is not None and spec["name"] not in layers:
            continue
        lead = spec["sites"][0] if spec["kind"] == "shared" else spec
        sites = tuple(spec["site_names"]) if spec["kind"] == "shared" else None
        out[spec["name"]] = LayerFacts(
            lead["layer_type"], decode_json(lead["module_kwargs"]), sites
        )
    return CaptureFacts(out)


def capture_dtype(header: dict, path: Path) -> torch.dtype | None:
    """The dtype a record was captured in when it was stored in another one (else ``None``)."""
    storage = header.get("storage") or {}
    name = storage.get("capture_dtype")
    if name is None or name == storage.get("dtype"):
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise StoreFormatError(f"shard {path} has a corrupted header: capture_dtype {name!r}.")
    return dtype


def read_gradient(
    f: Any,
    path: Path,
    entry: IndexEntry,
    layers: Sequence[str] | None,
    dtype: torch.dtype | None,
    rows: slice | None = None,
) -> Gradient:
    """Check an open shard's header against its line and rebuild the selected layers.

    Raises:
        StoreFormatError: naming the shard and what disagrees.
    """
    header = decode_schema(f.metadata().get(SHARD_METADATA_KEY), path)
    check_header_matches(header, entry, path)
    keys = tensor_keys(header["layers"], layers)
    try:
        for k in keys:
            shape = f.get_slice(k).get_shape()
            if not shape or shape[0] != entry["n"]:
                raise StoreFormatError(
                    f"shard {path} is corrupted: tensor {k!r} has shape {shape} for "
                    f"{entry['n']} samples."
                )
        if rows is None:
            tensors = {k: f.get_tensor(k) for k in keys}
        else:
            tensors = {k: f.get_slice(k)[rows] for k in keys}
    except (SafetensorError, KeyError) as e:
        raise StoreFormatError(f"shard {path} is corrupted: {e}") from None
    if dtype is None:  # a record stored narrower than captured reads back in the capture dtype
        dtype = capture_dtype(header, path)
    if dtype is not None:
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
    try:
        return decode_gradient(header["layers"], tensors, layers)
    except (ValueError, TypeError, KeyError, RuntimeError, IndexError) as e:
        raise StoreFormatError(
            f"shard {path} is corrupted: its tensors do not fit its header ({e})."
        ) from None
