"""Sample identity: content hashes that survive batching, shuffling and re-indexing.

A sample's hash is a SHA-256 over its sorted field names and, per field, the dtype, the
shape and the raw bytes of the tensor. The hash of ``dataset[i]`` equals the hash of row
``i`` of any batch that stacks it, whatever its position in the batch.

The identity rule — how to reproduce the id of a sample from the sample itself:

* **Captured by a** ``HookManager`` **(stores, callbacks)**: the hash of what the model was
  called with for that sample. Keyword tensors keep their keyword (``model(**batch)``,
  ``model(input_ids=ids)``); the first positional tensor is the field ``input_ids`` whatever
  the forward names its parameter (``model(x)`` -> ``hash_sample(x[i])``, since a bare tensor
  is hashed as ``input_ids``); other positional tensors keep their parameter name. Only
  ``input_ids`` is hashed when present (:data:`DEFAULT_HASH_KEYS`), else every tensor field;
  ``HookManagerConfig(hash_keys=...)`` picks the fields and ``sample_id_key`` /
  ``set_sample_ids`` replace hashes by your own ids.
* **Streamed live** (``attribute``, ``GradientStreamer``): the hash of the dataset item,
  ``hash_sample(item)`` (tuple items become fields ``"0"``, ``"1"``, ...).

Both agree for the usual dict items with ``input_ids``. Identical samples have identical
ids: a sample that occurs twice (at one step) gives two rows with one id, which
:class:`~dattri_llm.AttributionScore` reports instead of silently merging (its
``duplicates=`` option).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["hash_sample", "hash_batch", "DEFAULT_HASH_KEYS"]

#: Fields hashed by default when present: the token ids identify a language-model sample,
#: while ``labels`` / ``attention_mask`` are derived from them or differ between pipelines.
DEFAULT_HASH_KEYS: tuple[str, ...] = ("input_ids",)


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            return torch.from_numpy(value)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    return None


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.numpy().tobytes()


def _select_fields(inputs: Mapping[str, Any], keys: Sequence[str] | None) -> list[str]:
    tensor_fields = sorted(k for k, v in inputs.items() if _as_tensor(v) is not None)
    if keys is None:
        preferred = [k for k in DEFAULT_HASH_KEYS if k in tensor_fields]
        return preferred or tensor_fields
    missing = [k for k in keys if k not in tensor_fields]
    if missing:
        raise KeyError(
            f"hash keys {missing} are not tensor fields of the sample; available fields: "
            f"{tensor_fields}. Pass keys= with fields the sample has."
        )
    return sorted(keys)


def hash_sample(inputs: Mapping[str, Any] | torch.Tensor, keys: Sequence[str] | None = None) -> str:
    """Content hash of one sample.

    Args:
        inputs: A mapping of field name to tensor (one sample, no batch axis), or a bare
            tensor (hashed as the field ``input_ids``).
        keys: Fields to hash. By default ``input_ids`` when present, else every tensor field.

    Returns:
        The hex SHA-256 digest.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    fields = _select_fields(inputs, keys)
    if not fields:
        raise ValueError("hash_sample: the sample has no tensor fields to hash.")
    h = hashlib.sha256()
    for name in fields:
        t = _as_tensor(inputs[name])
        assert t is not None
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def hash_batch(
    inputs: Mapping[str, Any] | torch.Tensor, keys: Sequence[str] | None = None
) -> list[str]:
    """Content hashes of every row of a batch (batch axis first).

    ``hash_batch(batch)[i] == hash_sample({k: batch[k][i]})`` for every row ``i``.

    Args:
        inputs: A mapping of field name to batched tensor, or a bare batched tensor.
        keys: Fields to hash (see :func:`hash_sample`).

    Returns:
        One hex digest per row.
    """
    if isinstance(inputs, torch.Tensor):
        inputs = {"input_ids": inputs}
    fields = _select_fields(inputs, keys)
    tensors = {k: _as_tensor(inputs[k]) for k in fields}
    sizes = {k: t.shape[0] for k, t in tensors.items() if t is not None and t.dim() > 0}
    if not sizes:
        raise ValueError("hash_batch: no batched tensor fields to hash.")
    if len(set(sizes.values())) != 1:
        raise ValueError(f"hash_batch: fields disagree on the batch size: {sizes}.")
    n = next(iter(sizes.values()))
    return [hash_sample({k: t[i] for k, t in tensors.items()}, keys=fields) for i in range(n)]
