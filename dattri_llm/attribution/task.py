"""``AttributionTask``: what is attributed — a loss on the live model and the checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["AttributionTask", "unwrap_model"]

LossFunc = Callable[[nn.Module, Any], torch.Tensor]
Checkpoint = Any  # a state dict or a path


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP / FSDP (v1) wrapper; other models unchanged."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


class AttributionTask:
    """The model, the loss to attribute and the model states (checkpoints) to score at.

    Args:
        loss_func: ``loss_func(model, batch) -> scalar``, evaluated on the live model (so DDP
            and FSDP wrappers work). It must be the *sum* of the per-sample losses of the batch
            (multiply a Hugging Face mean loss by the batch length). Used for the train side.
        model: The model (or its DDP / FSDP wrapper).
        checkpoints: ``None`` scores at the current weights; otherwise a state dict or a path
            (or a list of them), loaded with ``torch.load(path, weights_only=True)`` and
            ``load_state_dict``, or with ``checkpoints_load_func``.
        target_func: Same signature as ``loss_func``; the function attributed on the test side
            (default: ``loss_func``).
        checkpoints_load_func: ``fn(model, checkpoint) -> model | None`` loading a checkpoint
            into the model (e.g. for sharded or Hugging Face checkpoints).

    After a run with checkpoints the model holds the last checkpoint's weights.
    """

    def __init__(
        self,
        loss_func: LossFunc,
        model: nn.Module,
        checkpoints: Checkpoint | Sequence[Checkpoint] | None = None,
        target_func: LossFunc | None = None,
        checkpoints_load_func: Callable[[nn.Module, Checkpoint], nn.Module | None] | None = None,
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
        self.loss_func = loss_func
        self.target_func = target_func
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
    def train_loss(self) -> LossFunc:
        """The function differentiated on the train side (``loss_func``)."""
        return self.loss_func

    @property
    def test_loss(self) -> LossFunc:
        """The function differentiated on the test side (``target_func`` or ``loss_func``)."""
        return self.target_func if self.target_func is not None else self.loss_func

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
        batch; ``reduction`` says how the batch loss relates to the per-sample losses:
        ``"sum"`` (used as is), ``"mean"`` (multiplied by the batch length) or ``"auto"``
        (decided on the first batch of more than one sample by comparing, without gradients,
        the batch loss with the per-sample losses; an error when it is neither).

        Args:
            dattri_task: The dattri task (its model, loss, target and checkpoints are reused).
            reduction: ``"auto"``, ``"sum"`` or ``"mean"``.
        """
        if reduction not in ("auto", "sum", "mean"):
            raise ValueError(f"reduction must be 'auto', 'sum' or 'mean', got {reduction!r}.")
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
            loss_func=_DattriLoss(loss, reduction),
            model=dattri_task.model,
            checkpoints=ckpts,
            target_func=None if target is loss else _DattriLoss(target, reduction),
            checkpoints_load_func=load,
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


def _row(batch: Any, i: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1]
    if isinstance(batch, Mapping):
        return {
            k: (v[i : i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
            for k, v in batch.items()
        }
    return type(batch)(
        v[i : i + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in batch
    )


class _DattriLoss:
    """``(model, batch) -> loss`` calling a dattri ``(params, data)`` loss on the live model."""

    def __init__(self, fn: Callable[[dict, Any], torch.Tensor], reduction: str) -> None:
        self.fn = fn
        self.reduction = reduction

    def _call(self, model: nn.Module, batch: Any) -> torch.Tensor:
        params = dict(unwrap_model(model).named_parameters())
        return self.fn(params, batch)

    def _decide(self, model: nn.Module, batch: Any, n: int) -> None:
        with torch.no_grad():
            full = float(self._call(model, batch))
            parts = [float(self._call(model, _row(batch, i))) for i in range(n)]
        total = sum(parts)
        tol = 1e-4 * max(abs(total), abs(full), 1e-12)
        if abs(full - total) <= tol:
            self.reduction = "sum"
        elif abs(full * n - total) <= tol * n:
            self.reduction = "mean"
        else:
            raise ValueError(
                f"the dattri loss on a batch of {n} ({full:.6g}) is neither the sum ({total:.6g}) "
                f"nor the mean ({total / n:.6g}) of its per-sample losses, so per-sample "
                "gradients cannot be read from one batched backward. Make the loss a sum or mean "
                "over the batch, or pass reduction= to AttributionTask.from_dattri."
            )

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        n = _batch_len(batch)
        if self.reduction == "auto" and n > 1:
            self._decide(model, batch, n)
        loss = self._call(model, batch)
        return loss * n if self.reduction == "mean" else loss


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
