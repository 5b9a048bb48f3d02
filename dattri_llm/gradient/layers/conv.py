"""Convolutions ``nn.Conv1d/2d/3d`` as outer products over output positions (im2col).

The ``a`` factor holds, for every output position, the receptive field it saw (``C_in * prod(k)``
values, channel-major as ``weight.reshape(C_out, -1)``), so the weight gradient is
``sum_t g_t a_t^T`` exactly as for a linear layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.gradient.layers.base import OuterProductRule

__all__ = ["ConvRule", "im2col"]


def im2col(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    dilation: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    """Receptive fields of an already padded ``(B, C, *spatial)`` input.

    Returns:
        ``(B, L, C * prod(kernel_size))`` with ``L`` the number of output positions, feature
        order ``(channel, kernel offsets row-major)`` as ``weight.reshape(C_out, -1)``.
    """
    nd = len(kernel_size)
    b, c = x.shape[:2]
    if nd == 2:
        cols = F.unfold(x, kernel_size, dilation=dilation, stride=stride)
        return cols.transpose(1, 2)
    if nd == 1:
        cols = F.unfold(
            x.unsqueeze(-2),
            (1, kernel_size[0]),
            dilation=(1, dilation[0]),
            stride=(1, stride[0]),
        )
        return cols.transpose(1, 2)
    spatial = x.shape[2:]
    out = [
        (n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(spatial, kernel_size, dilation, stride)
    ]
    pieces = []
    for offs in itertools.product(*[range(k) for k in kernel_size]):
        idx = (slice(None), slice(None)) + tuple(
            slice(o * d, o * d + (n - 1) * s + 1, s)
            for o, d, s, n in zip(offs, dilation, stride, out)
        )
        pieces.append(x[idx])
    cols = torch.stack(pieces, dim=2).reshape(b, c * len(pieces), -1)
    return cols.transpose(1, 2)


class ConvRule(OuterProductRule):
    """``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` (any stride, padding, dilation, padding mode)."""

    layer_type = "nn.Conv"
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def module_kwargs(self, module: nn.Module) -> dict:
        if module.groups != 1:
            raise NotImplementedError(
                f"convolution with groups={module.groups} is not supported (groups=1 only); "
                "exclude the layer from linear_io or capture it with param_grad."
            )
        nd = len(module.kernel_size)
        return {
            "in_channels": int(module.in_channels),
            "out_channels": int(module.out_channels),
            "kernel_size": list(module.kernel_size),
            "stride": list(module.stride),
            "dilation": list(module.dilation),
            "groups": 1,
            "bias": module.bias is not None,
            "ndim": nd,
            "pad": [int(p) for p in module._reversed_padding_repeated_twice],
            "padding_mode": str(module.padding_mode),
        }

    def num_features(self, kw: dict) -> int:
        kk = 1
        for k in kw["kernel_size"]:
            kk *= int(k)
        return int(kw["in_channels"]) * kk

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return int(kw["out_channels"]), self.matrix_columns(kw)

    def input_features(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        x = args[0].detach()
        if x.dim() == kw["ndim"] + 1:  # unbatched input
            x = x.unsqueeze(0)
        mode = kw.get("padding_mode", "zeros")
        x = F.pad(x, kw["pad"], mode="constant" if mode == "zeros" else mode)
        return im2col(x, kw["kernel_size"], kw["dilation"], kw["stride"])

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        if grad.dim() == kw["ndim"] + 1:
            grad = grad.unsqueeze(0)
        return grad.flatten(2).transpose(1, 2)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        k, d = self.matrix_shape(kw)
        out = self.split_matrix(dense.reshape(dense.shape[0], k, d), kw)
        if "weight" in out:
            cin = int(kw["in_channels"])
            out["weight"] = out["weight"].reshape(dense.shape[0], k, cin, *kw["kernel_size"])
        return out
