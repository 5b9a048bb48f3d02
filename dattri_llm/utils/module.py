"""Builders of ``module_kwargs``: the hyper-parameters a layer rule needs to interpret factors.

Use them with :class:`~dattri_llm.HookManagerConfig` when a layer's class is not one that
dattri_llm recognises (e.g. Hugging Face ``LlamaRMSNorm``) and is relabelled with
``layer_types``. Each builder returns a plain, JSON-serialisable dict.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "linear_module_kwargs",
    "conv_module_kwargs",
    "embedding_module_kwargs",
    "layer_norm_module_kwargs",
    "rms_norm_module_kwargs",
    "group_norm_module_kwargs",
    "instance_norm_module_kwargs",
]


def _shape(x: int | Sequence[int]) -> list[int]:
    return [int(x)] if isinstance(x, int) else [int(v) for v in x]


def linear_module_kwargs(in_features: int, out_features: int, bias: bool = True) -> dict:
    """Hyper-parameters of a linear layer ``y = x W^T + b``."""
    return {"in_features": int(in_features), "out_features": int(out_features), "bias": bool(bias)}


def conv_module_kwargs(
    in_channels: int,
    out_channels: int,
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    bias: bool = True,
    ndim: int = 2,
) -> dict:
    """Hyper-parameters of an ``ndim``-dimensional convolution (zero padding)."""

    def expand(v: int | Sequence[int]) -> list[int]:
        s = _shape(v)
        return s * ndim if len(s) == 1 else s

    pad = expand(padding)
    return {
        "in_channels": int(in_channels),
        "out_channels": int(out_channels),
        "kernel_size": expand(kernel_size),
        "stride": expand(stride),
        "dilation": expand(dilation),
        "groups": int(groups),
        "bias": bool(bias),
        "ndim": int(ndim),
        "pad": [p for v in reversed(pad) for p in (v, v)],
        "padding_mode": "zeros",
    }


def embedding_module_kwargs(
    num_embeddings: int, embedding_dim: int, padding_idx: int | None = None
) -> dict:
    """Hyper-parameters of an embedding table."""
    return {
        "num_embeddings": int(num_embeddings),
        "embedding_dim": int(embedding_dim),
        "padding_idx": None if padding_idx is None else int(padding_idx),
    }


def layer_norm_module_kwargs(
    normalized_shape: int | Sequence[int],
    eps: float = 1e-5,
    elementwise_affine: bool = True,
    bias: bool = True,
) -> dict:
    """Hyper-parameters of ``nn.LayerNorm``."""
    return {
        "normalized_shape": _shape(normalized_shape),
        "eps": float(eps),
        "weight": bool(elementwise_affine),
        "bias": bool(elementwise_affine and bias),
    }


def rms_norm_module_kwargs(
    normalized_shape: int | Sequence[int], eps: float | None = None, bias: bool = False
) -> dict:
    """Hyper-parameters of an RMSNorm (``nn.RMSNorm``, Hugging Face ``LlamaRMSNorm``, OLMo's).

    Args:
        normalized_shape: The trailing shape that is normalised (the hidden size).
        eps: The epsilon added to the mean square (HF stores it as ``variance_epsilon``).
            ``None`` means ``torch.finfo(dtype).eps`` as in ``nn.RMSNorm``.
        bias: The norm adds a bias after the scale, ``y = x_hat * w + b`` (OLMo's
            ``RMSLayerNorm`` / OLMo-core's ``RMSNorm`` with ``bias=True``); its gradient is
            then captured with the weight's. A module that has a bias declared without one
            gets a warning naming the uncaptured parameter.
    """
    return {
        "normalized_shape": _shape(normalized_shape),
        "eps": None if eps is None else float(eps),
        "weight": True,
        "bias": bool(bias),
    }


def group_norm_module_kwargs(
    num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True
) -> dict:
    """Hyper-parameters of ``nn.GroupNorm``."""
    return {
        "num_groups": int(num_groups),
        "num_channels": int(num_channels),
        "eps": float(eps),
        "weight": bool(affine),
        "bias": bool(affine),
    }


def instance_norm_module_kwargs(num_features: int, eps: float = 1e-5) -> dict:
    """Hyper-parameters of an affine ``nn.InstanceNorm{1,2,3}d`` (instance statistics)."""
    return {
        "num_channels": int(num_features),
        "eps": float(eps),
        "weight": True,
        "bias": True,
        "use_running_stats": False,
    }
