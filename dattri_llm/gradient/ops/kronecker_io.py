"""Persistence of K-FAC / EK-FAC covariances and fits: safetensors + JSON metadata, no pickle.

Each object is two files in a directory, ``<stem>.safetensors`` (tensors keyed
``"<layer>|<name>"``) and ``<stem>.json`` (``format``, ``version``, per-layer ``layer_type``,
``module_kwargs`` and counts). Loading checks the format name, the version and that every
tensor is present with the shape its layer's metadata implies.
"""

from __future__ import annotations

import json
import os

import torch

from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.ops.kronecker import (
    FORMAT_VERSION,
    DiagonalFisher,
    KroneckerCovariances,
    KroneckerFactors,
    LayerCovariance,
    LayerEigen,
)

__all__ = ["save_covariances", "load_covariances", "save_factors", "load_factors"]


def save_covariances(self: KroneckerCovariances, path: str | os.PathLike) -> None:
    """Write ``kronecker_covariances.{safetensors,json}`` into the directory ``path``."""
    tensors, layers = {}, {}
    for name, c in self.layers.items():
        tensors[f"{name}|a_sum"], tensors[f"{name}|g_sum"] = c.a_sum, c.g_sum
        layers[name] = {
            "layer_type": c.layer_type,
            "module_kwargs": c.module_kwargs,
            "num_tokens": c.num_tokens,
            "num_samples": c.num_samples,
        }
    diags = _put_diagonal(self.diagonal, tensors)
    meta = {
        "non_kronecker": self.non_kronecker,
        "tokens": self.tokens,
        "reduced": self.reduced,
        "layers": layers,
        "diagonal": diags,
        "skipped": self.skipped,
    }
    _write(path, "kronecker_covariances", tensors, meta)


def load_covariances(path: str | os.PathLike) -> KroneckerCovariances:
    """Read what :meth:`save` wrote, checking the format, version and shapes."""
    tensors, meta = _read(path, "kronecker_covariances")
    out = KroneckerCovariances(meta["non_kronecker"], meta["tokens"])
    out.reduced, out.skipped = bool(meta["reduced"]), dict(meta["skipped"])
    for name, m in meta["layers"].items():
        k, d = get_rule(m["layer_type"]).matrix_shape(m["module_kwargs"])
        a, g = (
            _get(tensors, path, f"{name}|a_sum", (d, d)),
            _get(tensors, path, f"{name}|g_sum", (k, k)),
        )
        out.layers[name] = LayerCovariance(
            m["layer_type"],
            m["module_kwargs"],
            a,
            g,
            float(m["num_tokens"]),
            float(m["num_samples"]),
        )
    out.diagonal.update(_get_diagonal(tensors, meta, path))
    return out


def save_factors(self: KroneckerFactors, path: str | os.PathLike) -> None:
    """Write ``kronecker_factors.{safetensors,json}`` into the directory ``path``."""
    tensors, layers = {}, {}
    for name, e in self.layers.items():
        for key in ("q_a", "s_a", "q_g", "s_g"):
            tensors[f"{name}|{key}"] = getattr(e, key)
        if e.corrected is not None:
            tensors[f"{name}|corrected"] = e.corrected
        layers[name] = {
            "layer_type": e.layer_type,
            "module_kwargs": e.module_kwargs,
            "num_samples": e.num_samples,
        }
    diags = _put_diagonal(self.diagonal, tensors)
    meta = {"kind": self.kind, "layers": layers, "diagonal": diags, "skipped": self.skipped}
    _write(path, "kronecker_factors", tensors, meta)


def load_factors(path: str | os.PathLike) -> KroneckerFactors:
    """Read what :meth:`save` wrote, validating format, version, layers and shapes."""
    tensors, meta = _read(path, "kronecker_factors")
    kind = meta.get("kind")
    if kind not in ("kfac", "ekfac"):
        raise ValueError(f"{path}: unknown kind {kind!r} (expected 'kfac' or 'ekfac').")
    layers = {}
    for name, m in meta["layers"].items():
        k, d = get_rule(m["layer_type"]).matrix_shape(m["module_kwargs"])
        corrected = _get(tensors, path, f"{name}|corrected", (k, d)) if kind == "ekfac" else None
        layers[name] = LayerEigen(
            m["layer_type"],
            m["module_kwargs"],
            _get(tensors, path, f"{name}|q_a", (d, d)),
            _get(tensors, path, f"{name}|s_a", (d,)),
            _get(tensors, path, f"{name}|q_g", (k, k)),
            _get(tensors, path, f"{name}|s_g", (k,)),
            corrected,
            float(m["num_samples"]),
        )
    diags = _get_diagonal(tensors, meta, path)
    return KroneckerFactors(kind, layers, diags, dict(meta["skipped"]))


def _put_diagonal(diagonal: dict[str, DiagonalFisher], tensors: dict) -> dict:
    """Add the diagonal Fishers' tensors to ``tensors``; return their JSON metadata."""
    meta = {}
    for name, dg in diagonal.items():
        tensors[f"{name}|sq_sum"] = dg.sq_sum
        meta[name] = {
            "layer_type": dg.layer_type,
            "module_kwargs": dg.module_kwargs,
            "num_samples": dg.num_samples,
        }
    return meta


def _get_diagonal(tensors: dict, meta: dict, path: str | os.PathLike) -> dict:
    """The diagonal Fishers described by ``meta["diagonal"]``, validated."""
    out = {}
    for name, m in meta["diagonal"].items():
        t = tensors.get(f"{name}|sq_sum")
        if t is None or t.dim() != 1:
            raise ValueError(f"{path}: diagonal Fisher of {name!r} is missing or not 1-D.")
        out[name] = DiagonalFisher(m["layer_type"], m["module_kwargs"], t, float(m["num_samples"]))
    return out


def _write(path: str | os.PathLike, stem: str, tensors: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    meta = {"format": f"dattri_llm.{stem}", "version": FORMAT_VERSION, **meta}
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        os.path.join(path, f"{stem}.safetensors"),
    )
    tmp = os.path.join(path, f"{stem}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(path, f"{stem}.json"))


def _read(path: str | os.PathLike, stem: str) -> tuple[dict, dict]:
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
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: version {meta.get('version')!r}; this dattri_llm reads "
            f"version {FORMAT_VERSION}. Refit, or use the matching dattri_llm."
        )
    return load_file(os.path.join(path, f"{stem}.safetensors")), meta


def _get(tensors: dict, path: object, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise ValueError(f"{path}: tensor {key!r} is missing; the files are incomplete.")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tuple(t.shape)}, expected {shape} "
            "from its layer's metadata."
        )
    return t
