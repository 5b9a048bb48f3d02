"""dattri_llm side of the benchmarks: hooked steps and :func:`pin_route`.

``pin_route(mode)`` forces every layer rule's routing predicates (Gram, norm, against-dense,
capture) to one answer, so that anything calling the ops with ``mode="auto"`` (attributors,
``Gradient.similarity``, ``capture_style="auto"``) takes the pinned route on every layer.
``pin_route("auto")`` leaves the cost model in charge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.layers import get_rule, supported_layer_types

__all__ = ["pin_route", "HookedStep", "PREDICATES"]

#: The routing predicates of a layer rule.
PREDICATES = (
    "prefer_materialized_gram",
    "prefer_materialized_norm",
    "prefer_materialized_against_dense",
    "prefer_materialized_capture",
)


@contextlib.contextmanager
def pin_route(mode: str) -> Iterator[None]:
    """Force every layer's route to ``"factorized"`` or ``"materialized"`` (``"auto"``: no-op).

    Patches the predicates on each registered rule instance (the ops reach rules through the
    registry) and restores them on exit.
    """
    if mode not in ("auto", "factorized", "materialized"):
        raise ValueError(f"mode must be 'auto', 'factorized' or 'materialized', got {mode!r}")
    if mode == "auto":
        yield
        return
    answer = mode == "materialized"
    rules = {id(r): r for r in (get_rule(t) for t in supported_layer_types())}.values()
    patched = []
    try:
        for rule in rules:
            for name in PREDICATES:
                if hasattr(rule, name):
                    had = name in vars(rule)
                    patched.append((rule, name, had, vars(rule).get(name)))
                    setattr(rule, name, lambda *a, _ans=answer, **k: _ans)
        yield
    finally:
        for rule, name, had, old in reversed(patched):
            if had:
                setattr(rule, name, old)
            else:
                delattr(rule, name)


class HookedStep:
    """A training step (zero grads, forward, loss, backward) under a ``HookManager``.

    Args:
        model: The model.
        loss_fn: ``(model, batch) -> loss``.
        config: The ``HookManagerConfig`` (capture style included).
        keep: Keep the record after the step (else it is dropped at once, as a callback
            that consumes records would).
    """

    def __init__(
        self, model: nn.Module, loss_fn: Callable, config: object, keep: bool = False
    ) -> None:
        self.model, self.loss_fn, self.config, self.keep = model, loss_fn, config, keep
        self.cb = CaptureCallback()
        self.hm: HookManager | None = None
        self.record: GradientRecord | None = None

    def setup(self) -> None:
        """Register the hooks (untimed)."""
        self.hm = HookManager(self.model, config=self.config, callbacks=[self.cb])

    def teardown(self) -> None:
        """Remove the hooks and drop the record (untimed)."""
        if self.hm is not None:
            self.hm.remove()
        self.hm = None
        if not self.keep:
            self.record = None

    def __call__(self, batch: torch.Tensor) -> GradientRecord:
        assert self.hm is not None, "call setup() first"
        self.model.zero_grad(set_to_none=True)
        with self.hm.collect():
            self.loss_fn(self.model, batch).backward()
        self.record = self.cb.pop()
        return self.record
