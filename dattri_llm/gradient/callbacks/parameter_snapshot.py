"""``ParameterSnapshotCallback``: record the parameters each step ran from, to replay its gradients.

Instead of storing every step's per-sample gradients, store θ_t (and the batch): a
:class:`~dattri_llm.ReplayGradientSource` reloads them and recomputes the step's per-sample
gradients under the hooks, exactly (dropout included: the random-number-generator state at the
step's first forward is recorded and restored).
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.hooks.config import canonical_name, is_data_parallel
from dattri_llm.gradient.optim.kinds import OptimizerLike, param_hypers, resolve_optimizer
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["ParameterSnapshotCallback", "trainable_parameters", "rng_states"]

_WHERE = "ParameterSnapshotCallback"


def trainable_parameters(model: nn.Module) -> dict[str, torch.nn.Parameter]:
    """``{name: parameter}`` of the parameters that require grad (wrapper prefixes dropped)."""
    dp = is_data_parallel(model)
    return {canonical_name(n, dp): p for n, p in model.named_parameters() if p.requires_grad}


def rng_states() -> dict[str, torch.Tensor]:
    """The CPU (and initialised CUDA) random-number-generator states."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"cuda{i}"] = s
    return out


class ParameterSnapshotCallback(HookCallback):
    """Write θ_t of every ``every``-th captured step to a :class:`TrajectorySnapshots`.

    Parameters are recorded in their own dtype at the end of the step's backward (before the
    update), with the random-number-generator state of the step's first forward and the
    model's training mode. With ``record_batches=True`` the model's inputs of that forward are
    recorded too (named by the ``forward`` signature, so ``loss_fn(model, batch)`` can call
    ``model(**batch)``); a hand-written loop whose loss needs more than the model inputs (e.g.
    labels) records its batches itself with ``snapshots.save_batch(step, batch)``.

    Args:
        model: The trained model.
        snapshots: The trajectory directory (or :class:`TrajectorySnapshots`).
        every: Record every ``every``-th step (steps in between cannot be replayed).
        record_batches: Record the model's inputs of each recorded step.
        optimizer: Optional; its learning rate is stored with each snapshot (the schedule
            DVEmb reads).
        gradient_accumulation_steps: Backward passes per optimizer update (steps as in
            ``OffloadCallback``); batches and random states are then not recorded.
    """

    def __init__(
        self,
        model: nn.Module,
        snapshots: TrajectorySnapshots | str | os.PathLike,
        every: int = 1,
        record_batches: bool = False,
        optimizer: OptimizerLike | None = None,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_WHERE}: model must be an nn.Module, got {type(model).__name__}.")
        for name, v in (
            ("every", every),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{_WHERE}: {name} must be an int >= 1, got {v!r}.")
        if record_batches and gradient_accumulation_steps > 1:
            raise ValueError(
                f"{_WHERE}: record_batches=True records one forward per step; with gradient "
                "accumulation record the batches yourself (snapshots.save_batch)."
            )
        if isinstance(snapshots, (str, os.PathLike)):
            snapshots = TrajectorySnapshots(snapshots)
        if not isinstance(snapshots, TrajectorySnapshots):
            raise TypeError(
                f"{_WHERE}: snapshots must be a TrajectorySnapshots or a directory, got "
                f"{type(snapshots).__name__}."
            )
        self.model = model
        self.snapshots = snapshots
        self.every = every
        self.record_batches = record_batches
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._forward: dict[str, Any] | None = None
        self._handle: Any = None
        try:
            self._signature = inspect.signature(model.forward)
        except (TypeError, ValueError):  # pragma: no cover
            self._signature = None

    def on_register(self, manager: CaptureHost) -> None:
        """Watch the model's forward for the random state (and inputs) of each step."""
        super().on_register(manager)
        self._handle = self.model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        manager = self.manager
        if manager is None or not manager.capturing or not torch.is_grad_enabled():
            return
        if self._forward is not None:
            return  # the step's first forward only
        state: dict[str, Any] = {"training": module.training}
        if self.gradient_accumulation_steps == 1:
            state["rng"] = rng_states()
        if self.record_batches:
            bound = dict(kwargs)
            if args:
                if self._signature is None:
                    raise ValueError(f"{_WHERE}: cannot name the model's positional inputs.")
                bound = self._signature.bind_partial(*args, **kwargs).arguments
                bound.update(bound.pop("kwargs", {}) or {})
            state["batch"] = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in bound.items()
                if v is not None
            }
        self._forward = state

    def on_step_end(self, record: GradientRecord) -> None:
        """Write θ_t (and the batch) of a recorded step."""
        forward, self._forward = self._forward, None
        n = self.gradient_accumulation_steps
        if record.step % n:
            return  # a later micro-batch of the same update: parameters are unchanged
        step = record.step // n
        if step % self.every:
            return
        params = {k: p.detach() for k, p in trainable_parameters(self.model).items()}
        meta: dict[str, Any] = {"every": self.every}
        if forward is not None:
            meta["training"] = bool(forward["training"])
        if self.optimizer is not None:
            opt = resolve_optimizer(self.optimizer, _WHERE)
            lrs = {h.lr for h in param_hypers(opt, _WHERE).values()}
            if len(lrs) == 1:
                meta["learning_rate"] = lrs.pop()
        rng = forward.get("rng") if forward is not None else None
        self.snapshots.save_parameters(step, params, rng=rng, meta=meta)
        if self.record_batches:
            if forward is None or "batch" not in forward:
                raise RuntimeError(f"{_WHERE}: step {step}'s model inputs were not seen.")
            self.snapshots.save_batch(step, forward["batch"])

    def on_context_end(self) -> None:
        """Forget a half-seen step."""
        self._forward = None

    def on_remove(self) -> None:
        """Remove the forward hook and close the trajectory's index."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self.snapshots.close()
