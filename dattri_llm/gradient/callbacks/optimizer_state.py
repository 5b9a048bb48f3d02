"""``OptimizerStateCallback``: record the optimizer state around every captured update.

What AdamW-influence (and DVEmb on a recorded SGD run) read: for each captured step, the state
the coming ``optimizer.step()`` reads (captured at the end of the step's backward, before the
update) and the state it leaves (``record_post(step)``, called by the user right after
``optimizer.step()``). See :mod:`dattri_llm.gradient.trajectory.dynamics` for the layout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.optim.kinds import (
    OptimizerLike,
    ParamHyper,
    param_hypers,
    param_state,
    resolve_optimizer,
)
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts, refuse_mixing_layouts
from dattri_llm.gradient.trajectory.dynamics import MemoryTrajectory, OptimizerDynamics
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["OptimizerStateCallback"]

_WHERE = "OptimizerStateCallback"
_ADAM_FIELDS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class OptimizerStateCallback(HookCallback):
    """Record the optimizer moments before and after every captured update.

    Call :meth:`record_post` with the step right after each ``optimizer.step()``, and pass
    :meth:`dynamics` to ``AdamWInfluenceAttributor(...).attribute_from_cache(...,
    dynamics=...)``. Moments are kept in the parameters' own dtype (float64 stays float64),
    laid out like the captured gradients of the hooked layers (all coordinates, or those of a
    ``"mask"`` projection).

    Steps are the gradient store's: with ``gradient_accumulation_steps = n`` the ``n``
    backward passes of one update share step ``micro_step // n`` (as in ``OffloadCallback``).
    Two backward passes without an update in between, undeclared, are refused.

    Args:
        model: The trained model (names as in the hook manager).
        optimizer: The optimizer (``torch.optim.SGD``, ``Adam`` or ``AdamW``), or a callable
            returning it (for trainers that build it late).
        snapshots: Write each step to this :class:`TrajectorySnapshots` (or directory) as it
            completes (memory stays bounded); default: keep the record in memory.
        gradient_accumulation_steps: Backward passes per optimizer update.

    Example:
        ```python
        rec = OptimizerStateCallback(model, opt)
        hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store), rec])
        with hm.collect():
            for step, batch in enumerate(loader):
                opt.zero_grad(); loss_fn(model, batch).backward(); opt.step()
                rec.record_post(step)
        dynamics = rec.dynamics()
        ```
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerLike,
        snapshots: TrajectorySnapshots | str | os.PathLike | None = None,
        gradient_accumulation_steps: int = 1,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_WHERE}: model must be an nn.Module, got {type(model).__name__}.")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                f"{_WHERE}: gradient_accumulation_steps must be an int >= 1, got "
                f"{gradient_accumulation_steps!r}."
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            param_hypers(optimizer, _WHERE)  # refuse an unsupported optimizer at once
        elif not callable(optimizer):
            resolve_optimizer(optimizer, _WHERE)
        if isinstance(snapshots, (str, os.PathLike)):
            snapshots = TrajectorySnapshots(snapshots)
        self.model = model
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._sink: TrajectorySnapshots | MemoryTrajectory = (
            snapshots if snapshots is not None else MemoryTrajectory()
        )
        self._layouts: dict[str, LayerLayout] = {}
        self._pending: dict[int, tuple[dict[str, torch.Tensor], dict, dict[str, int]]] = {}
        self._layout_written = False
        self._kind: str | None = None

    # ---- setup ---------------------------------------------------------------------------------
    def on_register(self, manager: CaptureHost) -> None:
        """Lay out the hooked layers' parameters (refusing what cannot be laid out)."""
        super().on_register(manager)
        for spec in manager.layers:
            if spec.hook_type != "linear_io":
                raise ValueError(
                    f"{_WHERE}: layer {spec.name!r} is hooked with {spec.hook_type!r}; the "
                    "trajectory methods need per-sample gradients (linear_io)."
                )
        layouts = layer_layouts(manager)
        refuse_mixing_layouts(layouts, _WHERE, "optimizer moments")
        self._layouts = layouts

    def _opt(self) -> torch.optim.Optimizer:
        return resolve_optimizer(self.optimizer, _WHERE)

    def _write_layout(self, opt: torch.optim.Optimizer, hypers: dict[int, ParamHyper]) -> None:
        covered = {id(p) for lay in self._layouts.values() for _, p in lay.params}
        uncovered = [
            n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in covered
        ]
        tensors, names = {}, {}
        for name, lay in self._layouts.items():
            index = {
                pname: torch.full(p.shape, float(i)) for i, (pname, p) in enumerate(lay.params)
            }
            tensors[f"coords.{name}"] = lay.gather(index).to(torch.int32)
            names[name] = [pname for pname, _ in lay.params]
        kinds = {hypers[id(p)].kind for lay in self._layouts.values() for _, p in lay.params}
        meta = {
            "kind": kinds.pop(),
            "optimizer": type(opt).__name__,
            "param_names": names,
            "uncovered": uncovered,
            "masked": any(lay.indices is not None for lay in self._layouts.values()),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }
        self._sink.save_layout(tensors, meta)
        self._kind = meta["kind"]
        self._layout_written = True

    # ---- recording -----------------------------------------------------------------------------
    def _read(
        self, opt: torch.optim.Optimizer, hypers: dict[int, ParamHyper], post: bool
    ) -> tuple[dict[str, torch.Tensor], dict, dict[str, int]]:
        tensors: dict[str, torch.Tensor] = {}
        layers_meta: dict[str, Any] = {}
        counts: dict[str, int] = {}
        suffix = ".post" if post else ""
        for name, lay in self._layouts.items():
            per: dict[str, ParamHyper] = {}
            for pname, p in lay.params:
                if id(p) not in hypers:
                    raise ValueError(
                        f"{_WHERE}: parameter {pname!r} of layer {name!r} is not in the "
                        "optimizer; exclude the layer from the hook config or give the optimizer "
                        "that trains it."
                    )
                per[pname] = hypers[id(p)]
            states = {pname: param_state(opt, p, per[pname]) for pname, p in lay.params}
            kind = next(iter(per.values())).kind
            if kind == "adam":
                for field in _ADAM_FIELDS:
                    if field in states[lay.params[0][0]]:
                        tensors[f"{name}|{field}{suffix}"] = lay.gather(
                            {n: s[field].detach().clone() for n, s in states.items()}
                        )
                for pname, s in states.items():
                    counts[f"{name}|{pname}"] = s["count"]
                layers_meta[name] = {
                    "hyper": {n: h.to_json() for n, h in per.items()},
                    "count": {n: s["count"] for n, s in states.items()},
                }
                coupled = any(h.weight_decay != 0 and not h.decoupled for h in per.values())
                if coupled and not post:
                    tensors[f"{name}|param"] = lay.gather({n: p.detach() for n, p in lay.params})
            else:
                bufs = {n: s["momentum_buffer"] for n, s in states.items()}
                if all(b is not None for b in bufs.values()):
                    tensors[f"{name}|momentum_buffer{suffix}"] = lay.gather(
                        {n: b.detach().clone() for n, b in bufs.items()}
                    )
                layers_meta[name] = {"hyper": {n: h.to_json() for n, h in per.items()}}
        lrs = {h["lr"] for m in layers_meta.values() for h in m["hyper"].values()}
        meta: dict[str, Any] = {"kind": self._kind, "layers": layers_meta}
        if len(lrs) == 1:
            meta["learning_rate"] = lrs.pop()
        return tensors, meta, counts

    def on_step_end(self, record: GradientRecord) -> None:
        """Capture the state the coming ``optimizer.step()`` reads."""
        step = record.step // self.gradient_accumulation_steps
        opt = self._opt()
        hypers = param_hypers(opt, _WHERE)
        if not self._layout_written:
            self._write_layout(opt, hypers)
        if step in self._pending:
            _, _, counts = self._read(opt, hypers, post=False)
            if counts != self._pending[step][2]:
                raise RuntimeError(
                    f"{_WHERE}: the optimizer updated between two backward passes of step {step} "
                    f"(gradient_accumulation_steps={self.gradient_accumulation_steps} declared); "
                    "declare the accumulation the loop really uses."
                )
            return
        if self._pending:
            waiting = sorted(self._pending)
            raise RuntimeError(
                f"{_WHERE}: step {step} started but record_post({waiting[0]}) was never called. "
                "Call record_post(step) right after every optimizer.step(); if the loop "
                "accumulates gradients over several backward passes per update, pass "
                "gradient_accumulation_steps=n here and to OffloadCallback."
            )
        if self._sink.has("dynamics", step):
            raise RuntimeError(f"{_WHERE}: step {step} was recorded already.")
        self._pending[step] = self._read(opt, hypers, post=False)

    def record_post(self, step: int) -> None:
        """Record the state ``optimizer.step()`` left; call it right after every update.

        Args:
            step: The step whose update just ran (the gradient store's step label).

        Raises:
            RuntimeError: no capture is waiting for ``step``, or the optimizer did not update.
        """
        step = int(step)
        if step not in self._pending:
            raise RuntimeError(
                f"{_WHERE}.record_post({step}): no captured step {step} is waiting for its update "
                f"(waiting: {sorted(self._pending) or 'none'}). Call it once per update, after "
                "optimizer.step(), with the step of the backward pass it applied."
            )
        opt = self._opt()
        hypers = param_hypers(opt, _WHERE)
        tensors, meta, counts = self._pending.pop(step)
        post, _, post_counts = self._read(opt, hypers, post=True)
        # the count read after the update is the *next* update's: one more than captured
        stale = [k for k, c in counts.items() if post_counts.get(k) != c + 1]
        if stale:
            raise RuntimeError(
                f"{_WHERE}.record_post({step}): the optimizer's update count of {stale[:3]} is not "
                "the one captured before the update: optimizer.step() ran zero or several times "
                "since the backward pass of this step."
            )
        if (
            meta["kind"] == "sgd"
            and not post
            and any(h["momentum"] for m in meta["layers"].values() for h in m["hyper"].values())
        ):
            raise RuntimeError(f"{_WHERE}.record_post({step}): no momentum buffer after the step.")
        tensors.update(post)
        self._sink.save_dynamics(step, tensors, meta)

    def dynamics(self) -> OptimizerDynamics:
        """The recorded dynamics (what ``AdamWInfluenceAttributor(dynamics=...)`` takes)."""
        if not self._layout_written:
            raise RuntimeError(f"{_WHERE}: nothing was recorded yet (no captured backward pass).")
        return OptimizerDynamics(self._sink)

    def on_remove(self) -> None:
        """Close the trajectory's index when the hooks come down."""
        if isinstance(self._sink, TrajectorySnapshots):
            self._sink.close()
