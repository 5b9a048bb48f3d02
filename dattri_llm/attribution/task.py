"""``AttributionTask``: what is attributed — a loss on the live model and the checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["AttributionTask", "SampleSumLoss", "unwrap_model"]

_REDUCTIONS = ("auto", "sum", "mean")

LossFunc = Callable[[nn.Module, Any], torch.Tensor]
Checkpoint = Any  # a state dict or a path


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP / FSDP (v1) wrapper; other models unchanged."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


class AttributionTask:
    """The model, the loss to attribute and the model states (checkpoints) to score at.

    **Loss reduction.** A per-sample gradient is the gradient of one sample's own loss, so the
    attributors need the batch loss to be the *sum* of the per-sample losses. A loss that is
    their *mean* (``model(**batch).loss`` of a Hugging Face model, ``reduction="mean"``) would
    scale every per-sample gradient by ``1 / batch size`` and make the scores depend on the
    batching (a partial last batch would weigh more). ``loss_reduction`` says how the batch
    loss relates to the per-sample losses:

    * ``"auto"`` (default): decided on the first batch of at least two samples by evaluating,
      without gradients, the loss of the batch and of each of its samples alone: a sum is used
      as is, a mean is multiplied by the batch length, and anything else (e.g. a Hugging Face
      loss averaged over the *tokens* of a padded batch, where samples have different numbers
      of label tokens) is refused with an error, since no per-sample gradient can be read from
      it. The check costs one no-grad forward per sample of that batch, once per function.
    * ``"sum"`` / ``"mean"``: declared; nothing is checked.

    Scores then never depend on how the data was batched. A Hugging Face model returns
    ``loss=None`` when the batch has no ``labels``: pass them (``model(**batch,
    labels=batch["input_ids"])``) or compute the loss from the logits.

    Args:
        loss_func: ``loss_func(model, batch) -> scalar``, evaluated on the live model (so DDP
            and FSDP wrappers work): the sum or the mean of the batch's per-sample losses (see
            ``loss_reduction``). Used for the train side.
        model: The model (or its DDP / FSDP wrapper).
        checkpoints: ``None`` scores at the current weights; otherwise a state dict or a path
            (or a list of them), loaded with ``torch.load(path, weights_only=True)`` and
            ``load_state_dict``, or with ``checkpoints_load_func``.
        target_func: Same signature as ``loss_func``; the function attributed on the test side
            (default: ``loss_func``).
        checkpoints_load_func: ``fn(model, checkpoint) -> model | None`` loading a checkpoint
            into the model (e.g. for sharded or Hugging Face checkpoints).
        loss_reduction: ``"auto"``, ``"sum"`` or ``"mean"``, for ``loss_func`` and
            ``target_func`` alike (each is decided on its own under ``"auto"``).

    After a run with checkpoints the model holds the last checkpoint's weights.

    Example:
        ```python
        def loss_fn(model, batch):  # a mean over the batch: multiplied by its length
            return model(**batch, labels=batch["input_ids"]).loss
        task = AttributionTask(loss_func=loss_fn, model=model)  # loss_reduction="auto"
        ```
    """

    def __init__(
        self,
        loss_func: LossFunc,
        model: nn.Module,
        checkpoints: Checkpoint | Sequence[Checkpoint] | None = None,
        target_func: LossFunc | None = None,
        checkpoints_load_func: Callable[[nn.Module, Checkpoint], nn.Module | None] | None = None,
        loss_reduction: str = "auto",
    ) -> None:
        if not callable(loss_func):
            raise TypeError(
                f"AttributionTask: loss_func must be callable (model, batch) -> "
                f"loss, got {type(loss_func).__name__}."
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"AttributionTask: model must be an nn.Module, got {type(model).__name__}."
            )
        if target_func is not None and not callable(target_func):
            raise TypeError("AttributionTask: target_func must be callable or None.")
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(
                f"AttributionTask: loss_reduction must be one of {_REDUCTIONS}, got "
                f"{loss_reduction!r}."
            )
        self.loss_func = loss_func
        self.target_func = target_func
        self.loss_reduction = loss_reduction
        self._train_loss = SampleSumLoss(loss_func, loss_reduction, "loss_func")
        self._test_loss = (
            self._train_loss
            if target_func is None
            else SampleSumLoss(target_func, loss_reduction, "target_func")
        )
        self.model = model
        if checkpoints is None:
            self.checkpoints: list[Checkpoint] | None = None
        elif isinstance(checkpoints, (Mapping, str, os.PathLike)):
            self.checkpoints = [checkpoints]
        else:
            self.checkpoints = list(checkpoints)
            if not self.checkpoints:
                raise ValueError(
                    "AttributionTask: checkpoints is an empty list; pass None to "
                    "score at the current weights."
                )
        if self.checkpoints is not None:
            self.checkpoints = [_detach_from_model(c, model) for c in self.checkpoints]
        self.checkpoints_load_func = checkpoints_load_func

    # ---- the two sides ---------------------------------------------------------------------
    @property
    def train_loss(self) -> SampleSumLoss:
        """The function differentiated on the train side: ``loss_func`` as a per-sample sum."""
        return self._train_loss

    @property
    def test_loss(self) -> SampleSumLoss:
        """The test side's function: ``target_func`` (or ``loss_func``) as a per-sample sum."""
        return self._test_loss

    # ---- checkpoints -----------------------------------------------------------------------
    @property
    def num_checkpoints(self) -> int:
        """Number of model states scored (1 when scoring at the current weights)."""
        return 1 if self.checkpoints is None else len(self.checkpoints)

    def load_checkpoint(self, index: int) -> nn.Module:
        """Load checkpoint ``index`` into the model (a no-op without checkpoints).

        Returns:
            The model holding that checkpoint's weights.
        """
        if self.checkpoints is None:
            if index != 0:
                raise IndexError(f"the task has no checkpoints; only index 0 exists, got {index}.")
            return self.model
        if not 0 <= index < len(self.checkpoints):
            raise IndexError(
                f"checkpoint index {index} out of range for {len(self.checkpoints)} checkpoints."
            )
        ckpt = self.checkpoints[index]
        if self.checkpoints_load_func is not None:
            out = self.checkpoints_load_func(self.model, ckpt)
            if isinstance(out, nn.Module):
                self.model = out
            return self.model
        target = unwrap_model(self.model)
        if isinstance(ckpt, (str, os.PathLike)):
            if not os.path.exists(ckpt):
                raise FileNotFoundError(f"checkpoint {index} not found: {os.fspath(ckpt)!r}.")
            param = next(target.parameters(), None)
            device = param.device if param is not None else "cpu"
            ckpt = torch.load(ckpt, weights_only=True, map_location=device)
        if not isinstance(ckpt, Mapping):
            raise TypeError(
                f"checkpoint {index} must be a state dict or a path, got "
                f"{type(ckpt).__name__}; pass checkpoints_load_func for other "
                "formats."
            )
        target.load_state_dict(ckpt)
        return self.model

    # ---- dattri interop --------------------------------------------------------------------
    @classmethod
    def from_dattri(cls, dattri_task: Any, reduction: str = "auto") -> AttributionTask:
        """Adapt a ``dattri.task.AttributionTask`` whose loss takes ``(params, data)``.

        The adapted loss calls dattri's loss with the live model's named parameters, so the
        ``functional_call`` inside it runs the model's modules and their hooks. dattri
        evaluates its loss on one sample at a time, while the live path evaluates it on a
        batch; ``reduction`` says how the batch loss relates to the per-sample losses, as the
        ``loss_reduction`` of :class:`AttributionTask`: ``"sum"`` (used as is), ``"mean"``
        (multiplied by the batch length) or ``"auto"`` (decided on the first batch of more
        than one sample; an error when it is neither).

        Args:
            dattri_task: The dattri task (its model, loss, target and checkpoints are reused).
            reduction: ``"auto"``, ``"sum"`` or ``"mean"``.
        """
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
        for attr in ("original_loss_func", "model", "checkpoints"):
            if not hasattr(dattri_task, attr):
                raise TypeError(
                    f"from_dattri expects a dattri.task.AttributionTask; "
                    f"{type(dattri_task).__name__} has no {attr!r}."
                )
        loss = dattri_task.original_loss_func
        target = getattr(dattri_task, "original_target_func", loss)
        load = getattr(dattri_task, "checkpoints_load_func", None)
        if load is not None and getattr(load, "__name__", "") == "_default_checkpoint_load_func":
            load = None  # ours loads paths with weights_only=True
        ckpts = [c for c in dattri_task.checkpoints if c is not None] or None
        return cls(
            loss_func=_DattriLoss(loss),
            model=dattri_task.model,
            checkpoints=ckpts,
            target_func=None if target is loss else _DattriLoss(target),
            checkpoints_load_func=load,
            loss_reduction=reduction,
        )

    @classmethod
    def coerce(cls, task: Any) -> AttributionTask | None:
        """``None``, an :class:`AttributionTask`, or a dattri task (adapted)."""
        if task is None or isinstance(task, cls):
            return task
        if hasattr(task, "original_loss_func") and hasattr(task, "model"):
            return cls.from_dattri(task)
        raise TypeError(
            f"task must be a dattri_llm AttributionTask or a dattri AttributionTask, "
            f"got {type(task).__name__}."
        )


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    raise ValueError("cannot find the batch length: the batch has no batched tensor.")


def _row(batch: Any, i: int, n: int) -> Any:
    """Sample ``i`` of a batch of ``n`` (tensors whose first axis is not the batch are kept)."""

    def one(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            return v[i : i + 1]
        return v

    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1]
    if isinstance(batch, Mapping):
        return {k: one(v) for k, v in batch.items()}
    return type(batch)(one(v) for v in batch)


def _loss_tensor(value: Any, name: str) -> torch.Tensor:
    """The loss a user function returned, or an error saying what it returned instead."""
    if isinstance(value, torch.Tensor):
        return value
    if value is None:
        raise TypeError(
            f"{name} returned None instead of a loss. A Hugging Face model returns loss=None "
            "when the batch has no labels: pass them, e.g. "
            'model(**batch, labels=batch["input_ids"]).loss, or compute the loss from the logits.'
        )
    if getattr(value, "loss", False) is None:
        raise TypeError(
            f"{name} returned a {type(value).__name__} whose loss is None: the batch has no "
            'labels. Pass labels= (e.g. labels=batch["input_ids"]) and return its .loss.'
        )
    if hasattr(value, "loss"):
        raise TypeError(
            f"{name} returned a {type(value).__name__}, not a loss tensor: return its .loss."
        )
    raise TypeError(f"{name} must return a scalar loss tensor, got {type(value).__name__}.")


def _tolerance(model: nn.Module, loss: torch.Tensor) -> float:
    """Relative tolerance of the reduction check: 1e-4, looser for half-precision models."""
    dtypes = [p.dtype for p in unwrap_model(model).parameters() if p.is_floating_point()]
    eps = max((torch.finfo(d).eps for d in [*dtypes, loss.dtype]), default=0.0)
    return max(1e-4, 4 * eps)


class SampleSumLoss:
    """``(model, batch) -> sum of the batch's per-sample losses``, from a summed or mean loss.

    The one mechanism behind :class:`AttributionTask`'s ``loss_reduction`` (see there): a
    ``"mean"`` loss is multiplied by the batch length, a ``"sum"`` is used as is, and
    ``"auto"`` decides on the first batch of at least two samples by comparing, without
    gradients, the batch loss with the losses of its samples evaluated one at a time.

    Args:
        fn: ``fn(model, batch) -> loss``.
        reduction: ``"auto"``, ``"sum"`` or ``"mean"``.
        name: How errors name ``fn`` (e.g. ``"loss_func"``).

    Attributes:
        reduction: ``"sum"`` or ``"mean"`` once decided (``"auto"`` before).
    """

    def __init__(self, fn: LossFunc, reduction: str = "auto", name: str = "loss_func") -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
        self.fn = fn
        self.reduction = reduction
        self.name = name

    def __repr__(self) -> str:
        return f"SampleSumLoss({self.name}, reduction={self.reduction!r})"

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The sum of the batch's per-sample losses."""
        loss = _loss_tensor(self.fn(model, batch), self.name)
        if self.reduction == "sum" or loss.dim() != 0:
            return loss  # a non-scalar is reported by the caller, which knows its rules
        n = _batch_len(batch)
        if self.reduction == "auto" and n > 1:
            self._decide(model, batch, n, loss)
        return loss * n if self.reduction == "mean" else loss

    def _decide(self, model: nn.Module, batch: Any, n: int, loss: torch.Tensor) -> None:
        full = float(loss.detach())
        try:
            with torch.no_grad():
                parts = [
                    float(_loss_tensor(self.fn(model, _row(batch, i, n)), self.name))
                    for i in range(n)
                ]
        except Exception as e:
            raise RuntimeError(
                f"loss_reduction='auto' evaluates {self.name} on each sample of the first batch "
                f"alone to tell whether it sums or averages the batch, and that failed "
                f"({type(e).__name__}: {e}). Declare it: AttributionTask(..., "
                "loss_reduction='sum') or loss_reduction='mean'."
            ) from e
        total = sum(parts)
        tol = _tolerance(model, loss) * max(abs(full), abs(total), *(abs(p) for p in parts))
        is_sum = abs(full - total) <= tol
        is_mean = abs(full * n - total) <= tol * n
        if is_sum and is_mean:
            raise ValueError(
                f"loss_reduction='auto' cannot tell whether {self.name} sums or averages: on "
                f"its first batch of {n} samples the per-sample losses add up to {total:.3g}, "
                "which sum and mean both give. Declare it: AttributionTask(..., "
                "loss_reduction='sum') or loss_reduction='mean'."
            )
        if not (is_sum or is_mean):
            raise ValueError(
                f"{self.name} on a batch of {n} samples gives {full:.6g}, which is neither the "
                f"sum ({total:.6g}) nor the mean ({total / n:.6g}) of the same samples' losses "
                "evaluated one at a time, so per-sample gradients cannot be read from one "
                "batched backward. A Hugging Face labels= loss is a mean over the batch's "
                "label tokens: with padding (labels -100) or samples of different lengths it "
                "weighs samples by their token counts. Return the sum of per-sample losses "
                "(e.g. cross_entropy(..., reduction='sum') over each sample's tokens, or the "
                "sum of per-sample means), or their plain mean."
            )
        self.reduction = "sum" if is_sum else "mean"


class _DattriLoss:
    """``(model, batch) -> loss`` calling a dattri ``(params, data)`` loss on the live model."""

    def __init__(self, fn: Callable[[dict, Any], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        params = dict(unwrap_model(model).named_parameters())
        return self.fn(params, batch)


def _detach_from_model(ckpt: Checkpoint, model: nn.Module) -> Checkpoint:
    """Copy the tensors of a state-dict checkpoint that share memory with the live model.

    ``model.state_dict()`` returns views of the live parameters: loading another checkpoint
    would silently overwrite such an entry, so it is snapshotted here.
    """
    if not isinstance(ckpt, Mapping):
        return ckpt
    live = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    if not any(
        isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live
        for v in ckpt.values()
    ):
        return ckpt
    return {
        k: v.detach().clone()
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live
        else v
        for k, v in ckpt.items()
    }
