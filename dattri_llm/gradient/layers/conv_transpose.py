"""Transposed convolutions ``nn.ConvTranspose1d/2d/3d`` as convolutions on a dilated input.

``conv_transpose(x, W)`` equals a stride-1 cross-correlation of ``x`` dilated by the stride and
padded by ``dilation * (k - 1) - padding`` (plus ``output_padding`` at the end) with the
spatially flipped, channel-transposed kernel. Capturing that convolution's receptive fields
makes the layer an outer product over *output* positions, bias included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.gradient.layers.conv import ConvRule, im2col

__all__ = ["ConvTransposeRule"]


class ConvTransposeRule(ConvRule):
    """``nn.ConvTranspose1d``, ``nn.ConvTranspose2d``, ``nn.ConvTranspose3d`` (groups=1)."""

    layer_type = "nn.ConvTranspose"
    module_types = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

    def module_kwargs(self, module: nn.Module) -> dict:
        if module.groups != 1:
            raise NotImplementedError(
                f"transposed convolution with groups={module.groups} is not supported (groups=1 "
                "only); exclude the layer from linear_io."
            )
        if module.padding_mode != "zeros":
            raise NotImplementedError("ConvTranspose supports padding_mode='zeros' only.")
        return {
            "in_channels": int(module.in_channels),
            "out_channels": int(module.out_channels),
            "kernel_size": list(module.kernel_size),
            "stride": list(module.stride),
            "padding": list(module.padding),
            "output_padding": list(module.output_padding),
            "dilation": list(module.dilation),
            "groups": 1,
            "bias": module.bias is not None,
            "ndim": len(module.kernel_size),
        }

    def input_features(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        x = args[0].detach()
        nd = kw["ndim"]
        if x.dim() == nd + 1:
            x = x.unsqueeze(0)
        spatial = output.shape[-nd:]
        b, c = x.shape[:2]
        stride, dil, ks = kw["stride"], kw["dilation"], kw["kernel_size"]
        dilated_shape = [(n - 1) * s + 1 for n, s in zip(x.shape[2:], stride)]
        xd = x.new_zeros(b, c, *dilated_shape)
        xd[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in stride)] = x
        pad: list[int] = []
        for i in reversed(range(nd)):
            lo = dil[i] * (ks[i] - 1) - kw["padding"][i]
            # the high side covers output_padding and any explicit output_size the call used
            hi = spatial[i] - 1 + dil[i] * (ks[i] - 1) - lo - (dilated_shape[i] - 1)
            pad += [lo, hi]
        xp = F.pad(xd, pad)
        return im2col(xp, ks, dil, [1] * nd)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        k, d = self.matrix_shape(kw)
        b = dense.shape[0]
        out = self.split_matrix(dense.reshape(b, k, d), kw)
        if "weight" in out:
            cin, nd = int(kw["in_channels"]), int(kw["ndim"])
            w = out["weight"].reshape(b, k, cin, *kw["kernel_size"])
            out["weight"] = w.flip(dims=tuple(range(3, 3 + nd))).transpose(1, 2)
        return out
