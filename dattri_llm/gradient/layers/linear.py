"""Linear layers: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2; weight stored ``(D, K)``)."""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm.gradient.layers.base import OuterProductRule

__all__ = ["LinearRule", "HFConv1DRule"]


class LinearRule(OuterProductRule):
    """``y = x W^T + b`` with any number of leading token axes (2-D input: one token)."""

    layer_type = "nn.Linear"
    module_types = (nn.Linear,)

    def module_kwargs(self, module: nn.Module) -> dict:
        return {
            "in_features": int(module.in_features),
            "out_features": int(module.out_features),
            "bias": module.bias is not None,
        }

    @staticmethod
    def _dims(kw: dict) -> tuple[int, int]:
        return int(kw["in_features"]), int(kw["out_features"])

    def num_features(self, kw: dict) -> int:
        return self._dims(kw)[0]

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return self._dims(kw)[1], self.matrix_columns(kw)

    def input_features(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        x = args[0].detach()
        d = self._dims(kw)[0]
        return x.reshape(x.shape[0], -1, d) if x.dim() > 1 else x.reshape(1, 1, d)

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        k = self._dims(kw)[1]
        return grad.reshape(grad.shape[0], -1, k) if grad.dim() > 1 else grad.reshape(1, 1, k)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        k = self._dims(kw)[1]
        out = self.split_matrix(dense.reshape(dense.shape[0], k, -1), kw)
        if "weight" in out:
            out["weight"] = self._weight(out["weight"])
        return out

    def _weight(self, m: torch.Tensor) -> torch.Tensor:
        return m


class HFConv1DRule(LinearRule):
    """Hugging Face ``transformers.pytorch_utils.Conv1D``: a linear layer storing W as (D, K)."""

    layer_type = "transformers.Conv1D"
    module_types = ()  # matched by class name, so transformers is never imported here

    def module_kwargs(self, module: nn.Module) -> dict:
        return {
            "in_features": int(module.nx),
            "out_features": int(module.nf),
            "bias": getattr(module, "bias", None) is not None,
        }

    def _weight(self, m: torch.Tensor) -> torch.Tensor:
        return m.transpose(1, 2)
