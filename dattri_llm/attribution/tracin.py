"""``TracInAttributor``: Grad-Dot, Grad-Cos and TracIn (a weighted sum over checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor
from dattri_llm.attribution.normalization import (
    SecondMoment,
    check_flag,
    check_second_moment,
    moment_at,
)
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

    Regime: a gradient-similarity score for retrieval, not an estimate of a removal's effect
    in either regime. Measured (docs/benchmarks/quality.md): on the GPT-2 fine-tuning
    setting Grad-Dot / TracIn reach half-data LDS 0.20 / 0.19 (EK-FAC 0.67) and are within
    their intervals of random at 1 % and 50 % removals; on digits-LR 0.26-0.36 at every removal
    fraction (EK-FAC 0.67-0.76). For fact tracing, checkpoints and unit normalization matter:
    TracIn-Cos over 3 checkpoints recall@10 0.875 against Grad-Cos's 0.53 at the final weights.

    TrackStar's optimizer correction (Chang et al., 2024): ``second_moment=SecondMoment(...)``
    multiplies every coordinate of the train and test gradients by ``1/√(v + ε)`` (Adam's second
    moment, see :class:`~dattri_llm.attribution.normalization.SecondMoment`) *before* the
    normalization of Grad-Cos, so ``normalized_grad=True`` with it scores
    ``cos(g/√(v+ε), q/√(v+ε))`` (TrackStar with the identity as its ``R``). Raw (or
    ``"mask"``-projected) gradients only: a store captured with a mixing projection is refused.

    ``normalized_grad`` is accepted by the constructor (the default of every call) and by
    every entry point (as in the original dattri-llm): a value given to a call overrides the
    constructor's for that call only; ``None`` uses the constructor's. Nothing is kept between
    calls.

    Args:
        args: Run options.
        task: An :class:`AttributionTask` (or a dattri task) for the live path.
        normalized_grad: Grad-Cos instead of Grad-Dot (the default of every call).
        checkpoint_weights: ``w_c`` per checkpoint: a sequence indexed by checkpoint label or
            a ``{checkpoint: weight}`` mapping.
        mode: Routing of the inner products (``"auto"``, ``"factorized"``, ``"materialized"``).
        second_moment: A :class:`~dattri_llm.attribution.normalization.SecondMoment`: correct
            both sides by ``1/√(v + ε)`` per coordinate (``None``: raw gradients); or one per
            checkpoint (a list indexed by checkpoint label, or ``{checkpoint: SecondMoment}``),
            each checkpoint's gradients corrected by its own optimizer state.
        repeats: How a train sample's rows under one checkpoint label combine (several
            epochs under one label, duplicates): ``"sum"`` or ``"mean"``; ``None``: ``"mean"``
            with ``normalized_grad`` (a cosine stays in ``[-1, 1]``), else ``"sum"``. See
            :meth:`~dattri_llm.attribution.base.BaseAttributor.default_repeats`.

    Example:
        Grad-Dot from two stores equals the stored gradients' inner products, and
        ``top_k`` streams the same top samples:

        >>> import tempfile, torch
        >>> from dattri_llm import (AttributionArguments, DiskGradientSource,
        ...                         GradientStorageManager, HookManager, OffloadCallback,
        ...                         TracInAttributor)
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> def capture(x):  # one store of per-sample gradients (summed loss: per-sample sums)
        ...     store = GradientStorageManager(tempfile.mkdtemp())
        ...     hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)])
        ...     with hm.collect(deregister_on_exit=True):
        ...         model(x).pow(2).sum().backward()
        ...     store.close()
        ...     return store.save_dir
        >>> train, test = capture(torch.randn(6, 3)), capture(torch.randn(2, 3))
        >>> args = AttributionArguments(output_dir=tempfile.mkdtemp())
        >>> score = TracInAttributor(args).attribute_from_cache(train, test)  # Grad-Dot
        >>> train_ids, matrix = score.agnostic_matrix()  # (train samples, queries)
        >>> matrix.shape
        torch.Size([6, 2])
        >>> def flat(path):  # the stored per-sample gradients, by sample id
        ...     rows = {}
        ...     for block in DiskGradientSource(path):
        ...         rows.update(zip(block.hashes, block.gradient.flatten()))
        ...     return rows
        >>> g, q = flat(train), flat(test)
        >>> train_rows = torch.stack([g[h] for h in train_ids])
        >>> brute = train_rows @ torch.stack([q[h] for h in score.test_hashes]).T
        >>> torch.allclose(matrix, brute, atol=1e-5)
        True
        >>> top = TracInAttributor(args).attribute_from_cache(train, test, top_k=3)  # streamed
        >>> top.top_k(3).proponent_hashes[0] == [train_ids[i] for i in brute[:, 0].topk(3).indices]
        True
    """

    vector_scan = True

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        normalized_grad: bool = False,
        checkpoint_weights: Sequence[float] | Mapping[int, float] | None = None,
        mode: str = "auto",
        second_moment: SecondMoment
        | Sequence[SecondMoment]
        | Mapping[int, SecondMoment]
        | None = None,
        repeats: str | None = None,
    ) -> None:
        super().__init__(args, task, mode=mode, repeats=repeats)
        self.normalized_grad = check_flag(normalized_grad, "TracInAttributor(normalized_grad=)")
        self.second_moment = check_second_moment(second_moment, "TracInAttributor(second_moment=)")
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

    # ---- the call's plan ------------------------------------------------------------------
    call_options = ("normalized_grad",)

    def check_option(self, name: str, value: Any, where: str) -> Any:
        """``normalized_grad`` of one call: ``True`` or ``False``."""
        return check_flag(value, where)

    def check_call(self, granularity: str, live: bool) -> None:
        """Refuse token granularity on corrected (materialized) gradients."""
        if granularity == "token" and self.second_moment is not None:
            raise ValueError(
                "TracInAttributor(second_moment=...) scores the corrected gradients, which are "
                "materialized (no token axis): use attribution_granularity='sample'."
            )

    # ---- scoring hooks ---------------------------------------------------------------------
    def _normalize(self, gradient: Gradient) -> Gradient:
        norms = ops.grad_norm_sq(gradient, mode=self.mode).clamp_min(0).sqrt()
        inv = 1.0 / norms.clamp_min(torch.finfo(norms.dtype).tiny)
        return gradient.scale(inv)

    def prepare_test(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Correct by the second moment (if given), then normalise for Grad-Cos."""
        if self.second_moment is not None:
            gradient = moment_at(self.second_moment, checkpoint).apply(gradient)
        return self._normalize(gradient) if self.normalized_grad else gradient

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Correct (second moment), normalise (Grad-Cos) and weight a checkpoint's train rows."""
        if self.second_moment is not None:
            gradient = moment_at(self.second_moment, checkpoint).apply(gradient)
        if self.normalized_grad:
            gradient = self._normalize(gradient)
        w = self.checkpoint_weight(checkpoint)
        return gradient if w == 1.0 else gradient.scale(w)
