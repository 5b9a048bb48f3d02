"""``ExactHessian``: each step's batch-loss Hessian, applied exactly by Hessian-vector products.

The trajectory methods need, at every step ``k``, the curvature ``H_k`` of the batch loss the
optimizer consumed. The default is its empirical Fisher from the captured per-sample gradients
(``κ Σ s sᵀ``: free, but only an approximation of ``H_k``). ``ExactHessian`` replays the step —
its parameters θ_k and batch from :class:`~dattri_llm.TrajectorySnapshots`, the training loss —
and applies the true Hessian by forward-over-reverse differentiation (``torch.func.jvp`` of
``torch.func.grad``, vmapped over the vectors), restricted to the captured coordinates (a
``"mask"`` capture: the masked block of ``H``). It costs a few backward passes per step and per
chunk of vectors, and gives the first-order influence with the true Hessian of every step.

Pass it as ``curvature=`` to :class:`~dattri_llm.AdamWInfluenceAttributor` or
:class:`~dattri_llm.DVEmbAttributor`. The model must not use randomness in its forward
(dropout off): a Hessian of a random loss is not defined.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.hooks import HookManager, HookManagerConfig
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts, refuse_mixing_layouts
from dattri_llm.gradient.trajectory.replay import has_active_dropout
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

__all__ = ["ExactHessian", "check_curvature"]


class _LossModule(nn.Module):
    """Wraps ``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap weights."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


class ExactHessian:
    """The true Hessian of each step's batch loss, from recorded parameters and batches.

    Args:
        model: The trained model (its architecture; the weights are the snapshots').
        snapshots: A :class:`TrajectorySnapshots` (or directory) with every step's parameters
            (``ParameterSnapshotCallback``) and batch (``save_batch`` / ``record_batches``).
        loss_fn: The training loss exactly as trained, ``(model, batch) -> scalar`` (same
            reduction: the Hessian is the consumed batch loss's).
        hook_config: The capture's hook config (maps captured coordinates to parameters,
            including a ``"mask"`` projection).
        chunk: Vectors per vmapped Hessian-vector product (memory vs speed).
    """

    def __init__(
        self,
        model: nn.Module,
        snapshots: TrajectorySnapshots | str | os.PathLike,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        hook_config: HookManagerConfig | None = None,
        chunk: int = 16,
    ) -> None:
        if isinstance(snapshots, (str, os.PathLike)):
            snapshots = TrajectorySnapshots(snapshots)
        if has_active_dropout(model):
            raise ValueError(
                "ExactHessian: the model has active dropout; the Hessian of a random loss is not "
                "defined. Train (and attribute) without dropout, or use the empirical Fisher."
            )
        self.model = model
        self.snapshots = snapshots
        self.loss = _LossModule(model, loss_fn)
        self.hook_config = hook_config or HookManagerConfig()
        self.chunk = int(chunk)
        self._layouts: dict[str, LayerLayout] | None = None

    def layouts(self) -> dict[str, LayerLayout]:
        """The captured layers' parameter layouts (resolved once, as the capture did)."""
        if self._layouts is None:
            hm = HookManager(self.model, config=self.hook_config)
            try:
                layouts = layer_layouts(hm)
            finally:
                hm.remove()
            refuse_mixing_layouts(layouts, "ExactHessian", "the Hessian's entries")
            self._layouts = layouts
        return self._layouts

    def operator(
        self, step: int, layers: list[str], dtype: torch.dtype, device: Any
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> H_step x`` for rows ``x`` ``(R, P)`` over ``layers``' captured coordinates."""
        from torch.func import functional_call, grad, jvp, vmap

        layouts = self.layouts()
        missing = [n for n in layers if n not in layouts]
        if missing:
            raise ValueError(
                f"ExactHessian: layers {missing} are not among the hook config's {list(layouts)}; "
                "pass the hook_config the gradients were captured with."
            )
        if not self.snapshots.has("parameters", step) or not self.snapshots.has("batch", step):
            raise KeyError(
                f"ExactHessian: step {step} has no recorded parameters and batch in "
                f"{self.snapshots.root} (ParameterSnapshotCallback, save_batch)."
            )
        recorded, _ = self.snapshots.load_parameters(step, device)
        batch = self.snapshots.load_batch(step, device)
        names = {id(p): "model." + n for n, p in self.model.named_parameters()}
        base = {
            "model." + n: recorded.get(n, p.detach()).to(device, dtype)
            for n, p in self.model.named_parameters()
        }
        base.update({"model." + n: b for n, b in self.model.named_buffers()})
        keys: list[str] = []  # the differentiated parameters, in the layers' order
        for n in layers:
            for _, p in layouts[n].params:
                if names[id(p)] not in keys:
                    keys.append(names[id(p)])
        widths = [layouts[n].num_coords for n in layers]

        def loss_of(*values: torch.Tensor) -> torch.Tensor:
            params = dict(base)
            params.update(dict(zip(keys, values)))
            return functional_call(self.loss, params, (batch,))

        primals = tuple(base[k] for k in keys)

        def to_params(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
            acc = {k: torch.zeros_like(base[k]) for k in keys}
            for n, part in zip(layers, rows.split(widths)):
                for pname, t in layouts[n].scatter(part[None]).items():
                    p = dict(layouts[n].params)[pname]
                    acc[names[id(p)]] = acc[names[id(p)]] + t[0]
            return tuple(acc[k] for k in keys)

        def to_rows(grads: tuple[torch.Tensor, ...]) -> torch.Tensor:
            by = dict(zip(keys, grads))
            parts = []
            for n in layers:
                lay = layouts[n]
                parts.append(lay.gather({pn: by[names[id(p)]] for pn, p in lay.params}))
            return torch.cat(parts)

        def hvp(row: torch.Tensor) -> torch.Tensor:
            tangents = to_params(row)
            _, out = jvp(grad(loss_of, argnums=tuple(range(len(keys)))), primals, tangents)
            return to_rows(out)

        def apply(x: torch.Tensor) -> torch.Tensor:
            x = x.to(device, dtype)
            chunks = [vmap(hvp)(c) for c in x.split(self.chunk)]
            return torch.cat(chunks) if chunks else x.clone()

        return apply


def check_curvature(curvature: Any, named: tuple[str, ...]) -> None:
    """Refuse a ``curvature`` that is neither one of ``named`` nor an :class:`ExactHessian`.

    Raises:
        ValueError: naming the accepted values.
    """
    if not isinstance(curvature, ExactHessian) and curvature not in named:
        raise ValueError(f"curvature must be one of {named} or an ExactHessian, got {curvature!r}.")
