"""``TracInAttributor``: Grad-Dot, Grad-Cos and TracIn (a weighted sum over checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor
from dattri_llm.gradient import ops
from dattri_llm.gradient.gradient import Gradient

__all__ = ["TracInAttributor"]


class TracInAttributor(BaseAttributor):
    """Gradient inner products between train and test samples, summed over checkpoints.

    * Grad-Dot: one checkpoint, ``score(z, z') = <grad l(z), grad l(z')>``.
    * Grad-Cos: ``normalized_grad=True`` divides every per-sample gradient (train and test) by
      its norm over all captured layers.
    * TracIn: several checkpoints (``AttributionTask(checkpoints=[...])`` live, or stores
      captured at several ``HookManager.checkpoint`` labels); the score is
      ``sum_c w_c <grad l_c(z), grad l_c(z')>`` with ``w_c`` from ``checkpoint_weights``
      (e.g. the learning rates; default 1). Rows of the result are per checkpoint (live) or
      per step (from a cache); :meth:`AttributionScore.agnostic_matrix` sums them.

    ``attribution_granularity="token"`` additionally splits each score over the train
    sample's token positions (exact: a layer's gradient is a sum over positions).

    Args:
        args: Run options.
        task: An :class:`AttributionTask` (or a dattri task) for the live path.
        normalized_grad: Grad-Cos instead of Grad-Dot.
        checkpoint_weights: ``w_c`` per checkpoint: a sequence indexed by checkpoint label or
            a ``{checkpoint: weight}`` mapping.
        mode: Routing of the inner products (``"auto"``, ``"factorized"``, ``"materialized"``).
    """

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        normalized_grad: bool = False,
        checkpoint_weights: Sequence[float] | Mapping[int, float] | None = None,
        mode: str = "auto",
    ) -> None:
        super().__init__(args, task, mode=mode)
        self.normalized_grad = bool(normalized_grad)
        if checkpoint_weights is not None:
            if isinstance(checkpoint_weights, Mapping):
                checkpoint_weights = {int(k): float(v) for k, v in checkpoint_weights.items()}
            else:
                checkpoint_weights = [float(w) for w in checkpoint_weights]
                n = self.task.num_checkpoints if self.task is not None else None
                if n is not None and len(checkpoint_weights) != n:
                    raise ValueError(
                        f"checkpoint_weights has {len(checkpoint_weights)} entries but the task "
                        f"has {n} checkpoint(s); give one weight per checkpoint."
                    )
        self.checkpoint_weights = checkpoint_weights

    def checkpoint_weight(self, checkpoint: int) -> float:
        """The weight ``w_c`` of a checkpoint (1 without ``checkpoint_weights``)."""
        w = self.checkpoint_weights
        if w is None:
            return 1.0
        try:
            return w[checkpoint]
        except (KeyError, IndexError):
            have = sorted(w) if isinstance(w, Mapping) else f"0..{len(w) - 1}"
            raise KeyError(
                f"checkpoint_weights has no weight for checkpoint {checkpoint} (it covers "
                f"{have}); give one weight per checkpoint label of the gradients."
            ) from None

    def _normalize(self, gradient: Gradient) -> Gradient:
        norms = ops.grad_norm_sq(gradient, mode=self.mode).clamp_min(0).sqrt()
        inv = 1.0 / norms.clamp_min(torch.finfo(norms.dtype).tiny)
        return gradient.scale(inv)

    def prepare_test(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Normalise the test gradients for Grad-Cos."""
        return self._normalize(gradient) if self.normalized_grad else gradient

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Normalise (Grad-Cos) and weight the train gradients of a checkpoint."""
        if self.normalized_grad:
            gradient = self._normalize(gradient)
        w = self.checkpoint_weight(checkpoint)
        return gradient if w == 1.0 else gradient.scale(w)
