"""Tensor bundles on disk: safetensors + JSON metadata, no pickle (K-FAC / EK-FAC persistence).

A bundle is two files in a directory, ``<stem>.safetensors`` (tensors keyed
``"<layer>|<name>"``) and ``<stem>.json`` (``format``, ``version`` and the caller's metadata).
Reading checks the format name and the version; :func:`checked_tensor` checks each tensor's
presence and shape. The Kronecker classes build on these (``KroneckerCovariances.save`` ...).
"""

from __future__ import annotations

import json
import os

import torch

from dattri_llm.utils.files import atomic_write

__all__ = ["write_bundle", "read_bundle", "checked_tensor"]


def write_bundle(
    path: str | os.PathLike, stem: str, tensors: dict, meta: dict, version: int
) -> None:
    """Write ``<stem>.{safetensors,json}`` into the directory ``path`` (JSON last, atomically)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    meta = {"format": f"dattri_llm.{stem}", "version": version, **meta}
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        os.path.join(path, f"{stem}.safetensors"),
    )
    atomic_write(os.path.join(path, f"{stem}.json"), json.dumps(meta, indent=1, sort_keys=True))


def read_bundle(path: str | os.PathLike, stem: str, version: int) -> tuple[dict, dict]:
    """Read a bundle written by :func:`write_bundle`, checking its format name and version."""
    from safetensors.torch import load_file

    meta_path = os.path.join(path, f"{stem}.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: {path} holds no saved {stem}.")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != f"dattri_llm.{stem}":
        raise ValueError(
            f"{meta_path}: format {meta.get('format')!r}, expected 'dattri_llm.{stem}'."
        )
    if meta.get("version") != version:
        raise ValueError(
            f"{meta_path}: version {meta.get('version')!r}; this dattri_llm reads "
            f"version {version}. Refit, or use the matching dattri_llm."
        )
    return load_file(os.path.join(path, f"{stem}.safetensors")), meta


def checked_tensor(tensors: dict, path: object, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensors[key]``, checked to exist with ``shape`` (errors name the bundle)."""
    t = tensors.get(key)
    if t is None:
        raise ValueError(f"{path}: tensor {key!r} is missing; the files are incomplete.")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tuple(t.shape)}, expected {shape} "
            "from its layer's metadata."
        )
    return t
