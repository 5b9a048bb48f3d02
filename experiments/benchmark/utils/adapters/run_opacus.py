"""Opacus ``GradSampleModule`` per-sample gradients (run in ``.venv-opacus``).

Opacus has grad samplers for ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm``; other leaf
modules with parameters (Hugging Face ``Conv1D``, ``LlamaRMSNorm``) fall back to its
``torch.func`` per-layer path.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["available", "OpacusStep"]


def available() -> bool:
    """Whether opacus imports in this interpreter."""
    try:
        import opacus  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class OpacusStep:
    """Wrap a model in ``GradSampleModule`` (sum reduction); each call runs one step.

    Per-sample gradients land in ``param.grad_sample``; :meth:`gram` builds their Gram.
    """

    def __init__(self, model: nn.Module, loss_fn: object) -> None:
        from opacus import GradSampleModule

        self.model = model
        self.loss_fn = loss_fn
        self.gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum")

    def __call__(self, batch: torch.Tensor) -> None:
        for p in self.model.parameters():
            p.grad = None
            p.grad_sample = None
        self.loss_fn(self.gsm, batch).backward()

    def per_sample(self) -> dict[str, torch.Tensor]:
        """``{param name: grad_sample}`` as Opacus left them."""
        return {
            n: p.grad_sample
            for n, p in self.model.named_parameters()
            if getattr(p, "grad_sample", None) is not None
        }

    def gram(self, batch_size: int) -> torch.Tensor:
        """Gram of the per-sample gradients; a ``grad_sample`` without a per-sample leading
        axis (a batch-summed one, e.g. GPT-2's ``wpe``) is counted as the same for every
        sample, which is what the user gets."""
        total = None
        for g in self.per_sample().values():
            f = g.reshape(g.shape[0], -1)
            if f.shape[0] != batch_size:
                f = f.sum(0, keepdim=True).expand(batch_size, -1)
            part = f @ f.T
            total = part if total is None else total + part
        return total

    def remove(self) -> None:
        """Take Opacus's hooks down."""
        self.gsm._close()
