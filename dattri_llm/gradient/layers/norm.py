"""Normalisation layers with an elementwise affine map: ``y = x_hat * w + b``.

``a`` is the normalised input ``x_hat`` and ``g`` the output gradient, both ``(B, T, C)`` with
the normalised features (or channels) last and positions as tokens. The per-sample gradient is
``[sum_t x_hat_t * g_t, sum_t g_t]``: it is as small as the layer, so inner products always
materialise (that is the cheap route here).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dattri_llm.gradient.layers.base import LayerRule
from dattri_llm.gradient.layers.hf_classes import hf_norm_form

__all__ = ["LayerNormRule", "RMSNormRule", "GroupNormRule", "InstanceNormRule"]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class _ElementwiseAffineRule(LayerRule):
    projection_styles = ("dense", "mask", "sparse")
    unit_scale_input = True

    def _channels(self, kw: dict) -> int:
        raise NotImplementedError

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return int(bool(kw.get("weight", True))) + int(bool(kw.get("bias"))), self._channels(kw)

    def zero_factors(
        self, b: int, kw: dict, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._channels(kw)
        z = torch.zeros((), dtype=dtype, device=device)
        return z.new_zeros(b, 1, c), z.new_zeros(b, 1, c)

    def _parts(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> list[torch.Tensor]:
        parts = [a * g] if kw.get("weight", True) else []
        if kw.get("bias"):
            parts.append(g)
        return parts

    def materialize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        return torch.cat([p.sum(1) for p in self._parts(a, g, kw)], dim=-1)

    def materialize_per_token(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        return torch.cat(self._parts(a, g, kw), dim=-1)

    def gram_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        return self.dense_per_token(a1, g1, self.materialize(a2, g2, kw), kw)

    def gram(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        return self.materialize(a1, g1, kw) @ self.materialize(a2, g2, kw).T

    def norm_sq(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        return self.materialize(a, g, kw).pow(2).sum(-1)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        b, c = dense.shape[0], self._channels(kw)
        m = dense.reshape(b, -1, c)
        shape = self._param_shape(kw)
        return {name: m[:, i].reshape(b, *shape) for i, name in enumerate(self.param_names(kw))}

    def _param_shape(self, kw: dict) -> list[int]:
        return [self._channels(kw)]

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        return self._tokens_last(grad, kw)

    def _tokens_last(self, x: torch.Tensor, kw: dict) -> torch.Tensor:
        raise NotImplementedError


class _TrailingShapeRule(_ElementwiseAffineRule):
    """Norms over the trailing ``normalized_shape`` (LayerNorm, RMSNorm)."""

    def _channels(self, kw: dict) -> int:
        return math.prod(int(v) for v in kw["normalized_shape"])

    def _param_shape(self, kw: dict) -> list[int]:
        return [int(v) for v in kw["normalized_shape"]]

    def _tokens_last(self, x: torch.Tensor, kw: dict) -> torch.Tensor:
        c = self._channels(kw)
        return (
            x.reshape(x.shape[0], -1, c)
            if x.dim() > len(kw["normalized_shape"])
            else x.reshape(1, -1, c)
        )

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        x = args[0].detach()
        dims = tuple(range(-len(kw["normalized_shape"]), 0))
        return self._tokens_last(self.normalize(x, dims, kw).to(x.dtype), kw)


class LayerNormRule(_TrailingShapeRule):
    """``nn.LayerNorm`` (with or without elementwise affine / bias)."""

    layer_type = "nn.LayerNorm"
    module_types = (nn.LayerNorm,)

    def module_kwargs(self, module: nn.Module) -> dict:
        return {
            "normalized_shape": [int(v) for v in module.normalized_shape],
            "eps": float(module.eps),
            "weight": module.weight is not None,
            "bias": getattr(module, "bias", None) is not None,
        }

    @staticmethod
    def normalize(x: torch.Tensor, dims: tuple[int, ...], kw: dict) -> torch.Tensor:
        """``(x - mean) / sqrt(var + eps)`` over ``dims`` (biased variance, as LayerNorm)."""
        x = _upcast(x)
        mean = x.mean(dims, keepdim=True)
        var = x.var(dims, keepdim=True, unbiased=False)
        return (x - mean) * torch.rsqrt(var + kw["eps"])


class RMSNormRule(_TrailingShapeRule):
    """``nn.RMSNorm``, the known Hugging Face RMS norms, any RMSNorm relabelled by ``layer_types``.

    The Hugging Face classes of :mod:`~dattri_llm.gradient.layers.hf_classes` (``LlamaRMSNorm``,
    Gemma's ``(1 + weight)`` norm, ...) are recognised by name; their eps is read from the
    attribute their form names. A ``bias`` parameter on the module (OLMo's norms can carry one)
    is read as ``y = x_hat * w + b``; the first-step coverage check verifies that reading.
    """

    layer_type = "nn.RMSNorm"
    module_types = (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()

    def module_kwargs(self, module: nn.Module) -> dict:
        form = hf_norm_form(module)
        if form is not None:
            eps = getattr(module, form.eps_attr)
        else:
            eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        shape = getattr(module, "normalized_shape", None) or tuple(module.weight.shape)
        kw = {
            "normalized_shape": [int(v) for v in shape],
            "eps": None if eps is None else float(eps),
            "weight": getattr(module, "weight", None) is not None,
            "bias": isinstance(getattr(module, "bias", None), torch.Tensor),
        }
        if form is not None:  # HF computes x_hat in float32 whatever the input dtype
            kw["compute_dtype"] = "float32"
        return kw

    @staticmethod
    def normalize(x: torch.Tensor, dims: tuple[int, ...], kw: dict) -> torch.Tensor:
        """``x / sqrt(mean(x^2) + eps)``; ``eps=None`` means the dtype's machine epsilon.

        With ``compute_dtype="float32"`` (the Hugging Face classes) ``x`` is cast to float32
        first, also from float64, as their forwards do.
        """
        dtype = x.dtype
        x = x.float() if kw.get("compute_dtype") == "float32" else _upcast(x)
        eps = kw.get("eps")
        if eps is None:
            eps = torch.finfo(dtype).eps
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)


class _ChannelRule(_ElementwiseAffineRule):
    """Channel-first norms with per-channel affine parameters (GroupNorm, InstanceNorm)."""

    def _channels(self, kw: dict) -> int:
        return int(kw["num_channels"])

    def _tokens_last(self, x: torch.Tensor, kw: dict) -> torch.Tensor:
        return x.reshape(x.shape[0], self._channels(kw), -1).transpose(1, 2)

    def _groups(self, kw: dict) -> int:
        raise NotImplementedError

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        x = args[0].detach()
        b = x.shape[0]
        xg = _upcast(x).reshape(b, self._groups(kw), -1)
        mean = xg.mean(-1, keepdim=True)
        var = xg.var(-1, keepdim=True, unbiased=False)
        xhat = ((xg - mean) * torch.rsqrt(var + kw["eps"])).reshape(x.shape).to(x.dtype)
        return self._tokens_last(xhat, kw)


class GroupNormRule(_ChannelRule):
    """``nn.GroupNorm`` (affine)."""

    layer_type = "nn.GroupNorm"
    module_types = (nn.GroupNorm,)

    def module_kwargs(self, module: nn.Module) -> dict:
        if not module.affine:
            raise ValueError("nn.GroupNorm(affine=False) has no parameters to attribute.")
        return {
            "num_groups": int(module.num_groups),
            "num_channels": int(module.num_channels),
            "eps": float(module.eps),
            "weight": True,
            "bias": True,
        }

    def _groups(self, kw: dict) -> int:
        return int(kw["num_groups"])


class InstanceNormRule(_ChannelRule):
    """``nn.InstanceNorm1d/2d/3d`` with ``affine=True`` using instance statistics."""

    layer_type = "nn.InstanceNorm"
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)

    def module_kwargs(self, module: nn.Module) -> dict:
        if not module.affine:
            raise ValueError(
                f"{type(module).__name__}(affine=False) has no parameters to attribute."
            )
        if module.track_running_stats and not module.training:
            raise NotImplementedError(
                "InstanceNorm in eval mode with track_running_stats=True normalises with running "
                "statistics, which is not supported; capture in train mode."
            )
        return {
            "num_channels": int(module.num_features),
            "eps": float(module.eps),
            "weight": True,
            "bias": True,
        }

    def _groups(self, kw: dict) -> int:
        return int(kw["num_channels"])
