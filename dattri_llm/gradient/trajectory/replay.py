"""``ReplayGradientSource``: recompute each step's per-sample gradients from recorded snapshots.

For every step with recorded parameters and batch, the model is loaded with θ_t, the batch is
run through ``loss_fn`` under a :class:`~dattri_llm.HookManager`, and the step's per-sample
gradients come out as one :class:`~dattri_llm.GradientBlock` — the same numbers the training
run captured (and the same sample identities, computed from the same model inputs). The model
is left exactly as it was found (parameters, gradients, ``requires_grad``, training modes,
buffers, random state).

Randomness: the step's forward runs in the training mode it was recorded in, with the
recorded random-number-generator state restored, so dropout masks are the training run's. A
step recorded without a random state is refused when the model has active dropout.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks.capture import CaptureCallback
from dattri_llm.gradient.callbacks.parameter_snapshot import trainable_parameters
from dattri_llm.gradient.gradient import GradientBlock
from dattri_llm.gradient.hooks import HookManager, HookManagerConfig
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots
from dattri_llm.utils.progress import progress

__all__ = ["ReplayGradientSource", "has_active_dropout"]

_WHERE = "ReplayGradientSource"


def has_active_dropout(model: nn.Module) -> bool:
    """Whether a module of ``model`` is a dropout with ``p > 0`` (torch's, or named like one)."""
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()
    ) or any(
        float(getattr(m, "p", 0) or 0) > 0 and "dropout" in type(m).__name__.lower()
        for m in model.modules()
    )


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(v, device) for v in batch)
    return batch


class ReplayGradientSource:
    """A :class:`~dattri_llm.GradientSource` that replays recorded steps.

    Args:
        model: The model the trajectory was recorded from (same architecture and names).
        snapshots: The :class:`TrajectorySnapshots` (or directory) with parameters and
            batches (``ParameterSnapshotCallback``, ``snapshots.save_batch``).
        loss_fn: ``loss_fn(model, batch) -> loss``, the training loss exactly as trained (same
            reduction: the captured gradient is each sample's share of it).
        hook_config: Which layers to capture (as at training time).
        steps: Replay only these steps (default: every step with parameters and a batch).
        checkpoint: Checkpoint label of the blocks.
        device: Where batches are moved (default: the model's device).
        show_progress: Show a progress bar while iterating (``None``: only on a terminal).

    ``rereadable`` is ``False`` (iterating again recomputes); :meth:`load_step` replays one step.
    """

    rereadable = False
    yields_blocks = True

    def __init__(
        self,
        model: nn.Module,
        snapshots: TrajectorySnapshots | str | os.PathLike,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        hook_config: HookManagerConfig | None = None,
        steps: Sequence[int] | None = None,
        checkpoint: int = 0,
        device: str | torch.device | None = None,
        show_progress: bool | None = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_WHERE}: model must be an nn.Module, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise TypeError(f"{_WHERE}: loss_fn must be callable (model, batch) -> loss.")
        if isinstance(snapshots, (str, os.PathLike)):
            if not os.path.isdir(snapshots):
                raise FileNotFoundError(f"{_WHERE}: trajectory directory {snapshots} not found.")
            snapshots = TrajectorySnapshots(snapshots)
        self.model = model
        self.snapshots = snapshots
        self.loss_fn = loss_fn
        self.hook_config = hook_config or HookManagerConfig()
        self.checkpoint = int(checkpoint)
        self.device = device
        self.show_progress = show_progress
        available = [s for s in snapshots.steps("parameters") if snapshots.has("batch", s)]
        if steps is None:
            self._steps = available
        else:
            self._steps = sorted(int(s) for s in steps)
            missing = sorted(set(self._steps) - set(available))
            if missing:
                raise KeyError(
                    f"{_WHERE}: steps {missing[:10]} have no recorded parameters and batch in "
                    f"{snapshots.root}; replayable steps: {available[:20]}."
                )
        if not self._steps:
            raise ValueError(
                f"{_WHERE}: {snapshots.root} has no step with both parameters and a batch "
                "(ParameterSnapshotCallback records parameters; batches come from "
                "record_batches=True or snapshots.save_batch(step, batch))."
            )

    def steps(self) -> list[int]:
        """The replayed steps, ascending."""
        return list(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[GradientBlock]:
        steps = progress(self._steps, self.show_progress, desc="replay")
        with self._preserved():
            for step in steps:
                yield self._replay(step)

    def load_step(self, step: int) -> list[GradientBlock]:
        """Replay one step (its blocks: one per step)."""
        if int(step) not in self._steps:
            raise KeyError(f"{_WHERE}: step {step} is not replayable; steps: {self._steps[:20]}.")
        with self._preserved():
            return [self._replay(int(step))]

    @contextlib.contextmanager
    def _preserved(self) -> Iterator[None]:
        """Restore every piece of model and random state the replay touches."""
        model = self.model
        params = list(model.parameters())
        saved = [p.detach().clone() for p in params]
        flags = [p.requires_grad for p in params]
        grads = [p.grad for p in params]
        buffers = [b.detach().clone() for b in model.buffers()]
        modes = [(m, m.training) for m in model.modules()]
        rng = torch.get_rng_state()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v, f, g in zip(params, saved, flags, grads):
                    p.copy_(v)
                    p.requires_grad_(f)
                    p.grad = g
                for b, v in zip(model.buffers(), buffers):
                    b.copy_(v)
            for m, t in modes:
                m.training = t
            torch.set_rng_state(rng)

    def _replay(self, step: int) -> GradientBlock:
        model = self.model
        params, rng = self.snapshots.load_parameters(step)
        live = trainable_parameters(model)
        missing = sorted(set(live) - set(params))
        if missing:
            raise KeyError(
                f"{_WHERE}: step {step}'s snapshot lacks trainable parameters {missing[:5]}; "
                "was it recorded from this model?"
            )
        meta = self.snapshots.meta("parameters", step)
        training = bool(meta.get("training", False))
        if training and has_active_dropout(model) and "cpu" not in rng:
            raise ValueError(
                f"{_WHERE}: the model has active dropout but step {step} was recorded without its "
                "random state, so replayed gradients would differ from the trained ones. Record "
                "with ParameterSnapshotCallback (gradient_accumulation_steps=1), or train without "
                "dropout."
            )
        device = self.device
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        batch = _move(self.snapshots.load_batch(step), torch.device(device))
        cb = CaptureCallback()
        hm = HookManager(model, config=self.hook_config, callbacks=[cb])
        try:
            with torch.no_grad():
                for name, p in live.items():
                    src = params[name]
                    if src.shape != p.shape:
                        raise ValueError(
                            f"{_WHERE}: parameter {name!r} has shape {tuple(src.shape)} at step "
                            f"{step}, the model's is {tuple(p.shape)}."
                        )
                    p.copy_(src)
            for p in model.parameters():
                p.grad = None
            model.train(training)
            if "cpu" in rng:
                torch.set_rng_state(rng["cpu"])
                cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
                if cuda and torch.cuda.is_available():
                    torch.cuda.set_rng_state_all(cuda)
            with torch.enable_grad(), hm.collect():
                loss = self.loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise ValueError(f"{_WHERE}: loss_fn must return a scalar tensor.")
                loss.backward()
        finally:
            hm.remove()
        rec = cb.pop()
        return GradientBlock(step, rec.gradient, list(rec.hashes), self.checkpoint)
