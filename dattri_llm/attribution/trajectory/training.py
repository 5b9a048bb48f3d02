"""A small training loop that records what the trajectory methods read (their live path).

``AdamWInfluenceAttributor.attribute`` and ``DVEmbAttributor.attribute`` train a *copy* of the
task's model on the train set (the user's model is left as it is), capturing every step's
per-sample gradients and the optimizer's moments, then score the queries at the trained
weights. The run is described by :class:`LiveRunArguments` (the method's ``live_run=``), with
``per_device_train_batch_size`` and ``seed`` (data order) from
:class:`~dattri_llm.AttributionArguments`. Everything stays in memory: record large runs from
your own loop (``OffloadCallback`` + ``OptimizerStateCallback``) and use
``attribute_from_cache``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from dattri_llm.gradient.callbacks.capture import CaptureCallback
from dattri_llm.gradient.callbacks.optimizer_state import OptimizerStateCallback
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.hooks import HookManager, HookManagerConfig
from dattri_llm.gradient.sources import InMemoryGradientSource
from dattri_llm.gradient.streaming import move_to_device, sample_id
from dattri_llm.gradient.trajectory.dynamics import OptimizerDynamics
from dattri_llm.utils.progress import progress_bar

__all__ = ["LiveRunArguments", "RecordedRun", "build_optimizer", "record_training"]

_OPTIMIZERS = ("auto", "adamw_torch", "adamw", "adam", "sgd")
_SCHEDULES = ("constant", "linear")


@dataclass
class LiveRunArguments:
    """The training run a trajectory method's live ``attribute`` trains and records.

    Attributes:
        learning_rate: Learning rate of the run.
        optimizer: ``"auto"`` (each method's own: AdamW for AdamW-influence, SGD for DVEmb),
            ``"adamw_torch"``, ``"adam"`` or ``"sgd"``.
        lr_scheduler_type: ``"linear"`` (decay to 0) or ``"constant"``.
        weight_decay: Weight decay of the run.
        gradient_accumulation_steps: Micro-batches per optimizer step.
        num_train_epochs: Epochs (fractions allowed).
        max_grad_norm: Gradient-norm clipping (0: none).
    """

    learning_rate: float = 5e-5
    optimizer: str = "auto"
    lr_scheduler_type: str = "linear"
    weight_decay: float = 0.0
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 1.0
    max_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        where = "LiveRunArguments"
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(
                f"{where}.optimizer must be one of {_OPTIMIZERS} for a recorded run, got "
                f"{self.optimizer!r}."
            )
        if self.lr_scheduler_type not in _SCHEDULES:
            raise ValueError(
                f"{where}.lr_scheduler_type must be one of {_SCHEDULES} for a recorded run, got "
                f"{self.lr_scheduler_type!r}."
            )
        steps = self.gradient_accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"{where}.gradient_accumulation_steps must be a positive int, got {steps!r}."
            )
        if not self.num_train_epochs > 0:
            raise ValueError(
                f"{where}.num_train_epochs must be > 0, got {self.num_train_epochs!r}."
            )
        if not self.max_grad_norm >= 0:
            raise ValueError(f"{where}.max_grad_norm must be >= 0, got {self.max_grad_norm!r}.")


@dataclass
class RecordedRun:
    """A training run recorded in memory.

    Attributes:
        model: The trained copy (at the final weights θ_T).
        gradients: Every step's per-sample gradients (one block per backward pass; the blocks
            of one update share its step).
        dynamics: The optimizer's moments around every update.
        steps: Number of optimizer updates.
    """

    model: nn.Module
    gradients: InMemoryGradientSource
    dynamics: OptimizerDynamics
    steps: int


def build_optimizer(
    name: str, model: nn.Module, lr: float, weight_decay: float, default: str
) -> torch.optim.Optimizer:
    """A torch optimizer from a ``LiveRunArguments.optimizer`` name (``"auto"``: default)."""
    name = default if name == "auto" else name
    params = [p for p in model.parameters() if p.requires_grad]
    if name in ("adamw_torch", "adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)


class _WithIds:
    def __init__(self, collate: Callable, config: HookManagerConfig) -> None:
        self.collate, self.config = collate, config

    def __call__(self, items: list) -> tuple[Any, list[str]]:
        return self.collate(items), [sample_id(it, self.config) for it in items]


def record_training(
    model: nn.Module,
    train_set: Any,
    loss_func: Callable[[nn.Module, Any], torch.Tensor],
    args: Any,
    run: LiveRunArguments,
    default_optimizer: str,
    hook_config: HookManagerConfig | None = None,
    collate_fn: Callable | None = None,
) -> RecordedRun:
    """Train a copy of ``model`` on ``train_set`` while recording gradients and moments.

    Args:
        model: The model to start from (not modified).
        train_set: Sequence or ``Dataset`` of samples.
        loss_func: ``(model, batch) -> loss``, the *sum* of the batch's per-sample losses.
        args: ``AttributionArguments`` (batch size, seed, progress).
        run: The run's optimizer, schedule and length.
        default_optimizer: The optimizer ``"auto"`` means.
        hook_config: Which layers to capture.
        collate_fn: Builds a batch from items (default ``default_collate``).
    """
    hook_config = hook_config or HookManagerConfig()
    trained = copy.deepcopy(model)
    trained.train()
    opt = build_optimizer(
        run.optimizer, trained, run.learning_rate, run.weight_decay, default_optimizer
    )
    accumulation = run.gradient_accumulation_steps
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        train_set,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=generator,
        collate_fn=_WithIds(collate_fn or default_collate, hook_config),
    )
    epochs = float(run.num_train_epochs)
    total = max(1, math.ceil(len(loader) * epochs / accumulation))
    if run.lr_scheduler_type == "linear":
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / total))
    else:
        schedule = None
    capture = CaptureCallback(keep_all=True)
    recorder = OptimizerStateCallback(trained, opt, gradient_accumulation_steps=accumulation)
    hm = HookManager(trained, config=hook_config, callbacks=[capture, recorder])
    device = next(trained.parameters()).device
    micro, update = 0, 0
    bar = progress_bar(args.show_progress, total=total, desc="recorded run", unit="step")
    with hm.collect(deregister_on_exit=True):
        opt.zero_grad(set_to_none=True)
        while update < total:
            for batch, ids in loader:
                hm.set_sample_ids(ids)
                loss_func(trained, move_to_device(batch, device)).backward()
                micro += 1
                if micro % accumulation:
                    continue
                if run.max_grad_norm and run.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(trained.parameters(), run.max_grad_norm)
                opt.step()
                recorder.record_post(update)
                opt.zero_grad(set_to_none=True)
                if schedule is not None:
                    schedule.step()
                update += 1
                if bar is not None:
                    bar.update(1)
                if update >= total:
                    break
    if bar is not None:
        bar.close()
    blocks = [  # the store's step labels: the micro-batches of one update share its step
        GradientRecord(r.step // accumulation, r.hashes, r.gradient, r.checkpoint, r.metadata)
        for r in capture.records
        if r.step // accumulation < update
    ]
    return RecordedRun(trained, InMemoryGradientSource(blocks), recorder.dynamics(), update)
