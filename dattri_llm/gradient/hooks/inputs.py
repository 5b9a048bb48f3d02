"""What identifies a captured sample: the model's batched inputs, bound to their names.

The rule (see :mod:`dattri_llm.utils.hashing`): a sample is identified by the content hash of
its model inputs — ``input_ids`` when present, else every batched tensor field (or
``hash_keys``) — or by ``sample_id_key``'s value, or by ids the loop sets
(``HookManager.set_sample_ids``). The first positional tensor passed to the model is its
``input_ids`` whatever the forward calls it, so ``hash_sample(x[i])`` finds ``model(x)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from dattri_llm.utils.hashing import hash_batch

__all__ = ["model_inputs", "sample_ids", "batch_shape"]


def model_inputs(
    signature: inspect.Signature | None, args: tuple, kwargs: dict
) -> dict[str, torch.Tensor]:
    """The batched tensors of one model call, by name (positional ones named by ``signature``)."""
    fields: dict[str, torch.Tensor] = {}
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = dict(kwargs)
    else:
        bound = dict(kwargs)
    first = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else None
    for k, v in bound.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            fields[k] = v
        elif k == "kwargs" and isinstance(v, dict):
            fields.update(
                {kk: vv for kk, vv in v.items() if isinstance(vv, torch.Tensor) and vv.dim() > 0}
            )
    if first is not None and "input_ids" not in fields:
        # the first positional tensor is the sample's ``input_ids`` whatever the forward calls
        # it, so hash_sample(x[i]) finds model(x)
        fields = {k: v for k, v in fields.items() if v is not first}
        fields["input_ids"] = first
    return fields


def sample_ids(
    inputs: dict | None,
    manual: list[str] | None,
    b: int,
    sample_id_key: str | None,
    hash_keys: Sequence[str] | None,
) -> list[str] | None:
    """One identity per row of a step's batch; ``None`` when the inputs were not seen.

    Raises:
        ValueError / KeyError: ids of the wrong length (``set_sample_ids``, or a
            ``sample_id_key`` field that is not one scalar id per row), or a ``sample_id_key``
            not among the inputs.
    """
    if manual is not None:
        if len(manual) != b:
            raise ValueError(f"set_sample_ids got {len(manual)} ids for a batch of {b}.")
        return manual
    if inputs and sample_id_key is not None:
        if sample_id_key not in inputs:
            raise KeyError(
                f"sample_id_key {sample_id_key!r} is not among the model inputs {sorted(inputs)}."
            )
        v = inputs[sample_id_key]
        if v.shape[0] != b or v.numel() != b:
            raise ValueError(
                f"sample_id_key {sample_id_key!r}: the model input {sample_id_key!r} has shape "
                f"{tuple(v.shape)} for a batch of {b} samples; it must hold exactly one id per "
                f"sample, shape ({b},). Give every sample of the batch its own scalar id in that "
                "field (or HookManager.set_sample_ids(ids)), or drop sample_id_key to identify "
                "samples by the content hash of their inputs."
            )
        return [str(x) for x in v.reshape(b).tolist()]
    if inputs:
        batched = {k: v for k, v in inputs.items() if v.shape[0] == b}
        if batched:
            return hash_batch(batched, keys=_keys_for(hash_keys, batched))
    return None


def _keys_for(keys: Sequence[str] | None, batched: dict) -> list[str] | None:
    if keys is None:
        return None
    present = [k for k in keys if k in batched]
    return present or None


def batch_shape(fields: dict | None, batch_size: int | None) -> tuple[int | None, int | None]:
    """``(batch size, tokens per sample)`` of the model's batch.

    Tokens are read from ``input_ids`` or ``inputs_embeds`` only (``None`` otherwise: a layer
    fed flattened rows is then not checked against them).
    """
    for key in ("input_ids", "inputs_embeds"):
        x = (fields or {}).get(key)
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return batch_size, int(x.shape[1])
    return batch_size, None
