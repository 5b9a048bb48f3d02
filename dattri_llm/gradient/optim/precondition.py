"""Preconditioned capture: each sample's gradient mapped through the optimizer's update (LESS).

With ``HookManager(model, optimizer=opt)`` every captured per-sample gradient becomes the update
direction the optimizer would take *if that sample alone were the batch*, from the state the
coming ``optimizer.step()`` reads (Xia et al., 2024). Per coordinate, with ``g`` the sample's
gradient (times ``scale``), negated under ``maximize``, plus ``λθ`` under coupled weight decay:

* Adam / AdamW (count ``c`` = the optimizer's own ``state["step"] + 1``, not the capture index):
  ``m = β₁m + (1−β₁)g``, ``v = β₂v + (1−β₂)g²`` (AMSGrad: ``v = max(v_max, v)``),
  ``Γ = (m / (1−β₁ᶜ)) / (√v / √(1−β₂ᶜ) + ε)`` — torch's placement of ``ε`` (outside the root) and
  its bias corrections. AdamW's decoupled decay is not part of the direction.
* SGD: without momentum ``Γ = g``; with momentum ``b = μ b + (1−d) g`` (``b = g`` before the
  first step), ``Γ = b``, or ``g + μ b`` with Nesterov.

The map is nonlinear, so it runs on the step's complete gradient of each parameter: after the
calls of a reused module are summed and after the sites of a tied parameter are summed, on the
materialised gradient — or on the exact entries of a ``"mask"`` projection (gathered straight from
the factors) — and before a ``"dense"`` projection. ``"logra"`` (it mixes coordinates before the
map could run) and ``param_grad`` layers (batch gradients) are refused.

The captured gradient of a sample is its *share* of the batch loss as trained (``∇ℓ/B`` for a
mean loss). Γ is not scale-free once the moments are non-zero, so ``scale`` turns the share into
the gradient the paper means: ``scale="batch_size"`` multiplies by the step's batch size
(``∇ℓ`` for a mean loss), a number multiplies by itself. The default ``1.0`` maps the share as
captured (right for a sum loss).

``precondition="second_moment"`` selects the other capture-time map, TrackStar's
``g/√(v + ε)`` (:mod:`dattri_llm.gradient.optim.second_moment`), built on this one's checks and
on :func:`map_and_project`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.layer_gradient import LayerGradient, Materialized
from dattri_llm.gradient.optim.kinds import (
    OptimizerLike,
    ParamHyper,
    param_hypers,
    param_state,
    resolve_optimizer,
)
from dattri_llm.gradient.optim.layout import LayerLayout, layer_layouts

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["Preconditioner", "map_and_project"]

_WHERE = "HookManager(optimizer=...)"


class Preconditioner:
    """Maps a step's per-sample gradients to the optimizer's per-sample update directions.

    Built by :class:`~dattri_llm.HookManager` when an ``optimizer`` is given.

    Args:
        optimizer: The training optimizer, or a callable returning it.
        scale: ``"batch_size"`` or a number multiplying each captured gradient before the map.

    Attributes:
        enabled: Turn the map off for a raw pass (see :meth:`disabled`).
    """

    def __init__(self, optimizer: OptimizerLike, scale: float | str = 1.0) -> None:
        if not (scale == "batch_size" or isinstance(scale, (int, float))) or isinstance(
            scale, bool
        ):
            raise ValueError(
                f"{_WHERE}: precondition_scale must be a number or 'batch_size', got {scale!r}."
            )
        if isinstance(optimizer, torch.optim.Optimizer):
            resolve_optimizer(optimizer, _WHERE)
            param_hypers(optimizer, _WHERE)  # refuse an unsupported optimizer at once
        elif not callable(optimizer):
            resolve_optimizer(optimizer, _WHERE)  # raises with the message
        self.optimizer = optimizer
        self.scale = scale
        self.enabled = True
        self.layouts: dict[str, LayerLayout] = {}

    def bind(self, manager: CaptureHost) -> None:
        """Check the manager's configuration and lay out its layers' parameters."""
        for spec in manager.layers:
            if spec.hook_type != "linear_io":
                raise ValueError(
                    f"{_WHERE}: layer {spec.name!r} is hooked with {spec.hook_type!r}, which sees "
                    "the batch gradient; preconditioned capture needs per-sample gradients "
                    "(hook it with linear_io, or exclude it)."
                )
            lp = manager.projection[spec.name] if manager.projection is not None else None
            if lp is not None and lp.style == "logra":
                raise ValueError(
                    f"{_WHERE}: layer {spec.name!r} uses the 'logra' projection, which mixes "
                    "coordinates before the optimizer's per-coordinate map could run. Use no "
                    "projection, 'mask', 'dense' or 'sparse' (applied after the map)."
                )
        self.layouts = layer_layouts(manager)

    def defers_projection(self, projection: Any) -> bool:
        """Whether a layer's capture-time projection must wait until after the map."""
        return self.enabled and projection is not None and projection.style in ("dense", "sparse")

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Capture raw gradients inside the block (e.g. the query side with one manager)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    # ---- the map -------------------------------------------------------------------------------
    def apply(
        self, layers: dict[str, LayerGradient], batch_size: int, projection: Any
    ) -> tuple[dict[str, LayerGradient], dict[str, Any]]:
        """Map every layer of one step; returns the new layers and the record's metadata."""
        opt = resolve_optimizer(self.optimizer, _WHERE)
        hypers = param_hypers(opt, _WHERE)
        lrs: set[float] = set()
        counts: set[int] = set()

        def direction(name: str, g: torch.Tensor) -> torch.Tensor:
            gamma, lr, count = self._map_layer(opt, hypers, self.layouts[name], g)
            lrs.update(lr)
            counts.update(count)
            return gamma

        out = map_and_project(layers, projection, direction, self.step_scale(batch_size))
        meta: dict[str, Any] = {
            "preconditioned": {
                "optimizer": type(opt).__name__,
                "scale": self.scale,
            }
        }
        if len(counts) == 1:
            meta["preconditioned"]["optimizer_step"] = counts.pop()
        if len(lrs) == 1:
            meta["learning_rate"] = lrs.pop()
        else:
            meta["learning_rates"] = sorted(lrs)
        return out, meta

    def step_scale(self, batch_size: int) -> float:
        """The factor each captured gradient is multiplied by before the map."""
        return float(batch_size) if self.scale == "batch_size" else float(self.scale)

    def _map_layer(
        self,
        opt: torch.optim.Optimizer,
        hypers: dict[int, ParamHyper],
        layout: LayerLayout,
        g: torch.Tensor,
    ) -> tuple[torch.Tensor, set[float], set[int]]:
        per_param: dict[str, ParamHyper] = {}
        for pname, p in layout.params:
            if id(p) not in hypers:
                if any(
                    getattr(q, "_is_flat_param", False)
                    for g in opt.param_groups
                    for q in g["params"]
                ):
                    raise ValueError(
                        f"{_WHERE}: the optimizer trains FSDP1 flat parameters "
                        "(FullyShardedDataParallel(..., use_orig_params=False), here applied "
                        f"after the hooks were registered), not parameter {pname!r} of layer "
                        f"{layout.name!r}: per-parameter update directions need the original "
                        "parameters. Wrap with FullyShardedDataParallel(..., use_orig_params=True) "
                        "or use FSDP2 (torch.distributed.fsdp.fully_shard)."
                    )
                raise ValueError(
                    f"{_WHERE}: parameter {pname!r} of layer {layout.name!r} is not updated by "
                    "the optimizer, so it has no update direction. Pass the optimizer that "
                    "trains it, or exclude the layer."
                )
            per_param[pname] = hypers[id(p)]
        kinds = {h.kind for h in per_param.values()}
        (kind,) = kinds
        state = {pname: param_state(opt, p, per_param[pname]) for pname, p in layout.params}
        dtype = torch.promote_types(g.dtype, layout.params[0][1].dtype)
        g = g.to(dtype)
        device = g.device

        def coord(field: str) -> torch.Tensor:
            return layout.expand(
                {n: float(getattr(h, field)) for n, h in per_param.items()}, dtype, device
            )

        def gathered(key: str) -> torch.Tensor:
            return layout.gather({n: state[n][key].detach() for n in state}).to(device, dtype)

        maximize = coord("maximize")
        g = torch.where(maximize > 0, -g, g)
        wd = coord("weight_decay") * (1.0 - coord("decoupled"))
        if bool((wd != 0).any()):
            theta = layout.gather({n: p.detach() for n, p in layout.params}).to(device, dtype)
            g = g + wd * theta
        lrs = {h.lr for h in per_param.values()}
        if kind == "adam":
            counts = {state[n]["count"] for n in state}
            count = layout.expand({n: state[n]["count"] for n in state}, dtype, device)
            b1, b2, eps = coord("beta1"), coord("beta2"), coord("eps")
            m = b1 * gathered("exp_avg") + (1 - b1) * g
            v = b2 * gathered("exp_avg_sq") + (1 - b2) * g * g
            amsgrad = coord("amsgrad")
            if bool((amsgrad > 0).any()):
                vmax = torch.maximum(gathered("max_exp_avg_sq"), v)
                v = torch.where(amsgrad > 0, vmax, v)
            bc1 = 1 - b1**count
            bc2_sqrt = (1 - b2**count).sqrt()
            return (m / bc1) / (v.sqrt() / bc2_sqrt + eps), lrs, counts
        mom = coord("momentum")
        if not bool((mom != 0).any()):
            return g, lrs, set()
        bufs = {n: state[n]["momentum_buffer"] for n in state}
        if any(b is None for b in bufs.values()):
            if not all(b is None for b in bufs.values()):
                raise ValueError(
                    f"{_WHERE}: layer {layout.name!r} mixes parameters with and without a "
                    "momentum buffer; cannot map it consistently."
                )
            buf = g
        else:
            buf = (
                mom * layout.gather({n: b.detach() for n, b in bufs.items()}).to(device, dtype)
                + (1 - coord("dampening")) * g
            )
        nesterov = coord("nesterov")
        gamma = torch.where(nesterov > 0, g + mom * buf, buf)
        return torch.where(mom != 0, gamma, g), lrs, set()


def map_and_project(
    layers: dict[str, LayerGradient],
    projection: Any,
    fn: Callable[[str, torch.Tensor], torch.Tensor],
    scale: float,
) -> dict[str, LayerGradient]:
    """Each layer's complete gradient times ``scale``, mapped by ``fn(name, rows)``, projected.

    Every layer is materialised first (the calls of a reused module and the sites of a tied
    parameter summed: a map needs the whole gradient; a ``"mask"`` layer is already its exact
    entries), and a ``"dense"`` / ``"sparse"`` projection is applied after the map.
    """
    out: dict[str, LayerGradient] = {}
    for name, lg in layers.items():
        dense = lg.materialize()
        item: LayerGradient = Materialized(
            fn(name, dense.data * scale), dense.layer_type, dense.module_kwargs
        )
        lp = projection[name] if projection is not None else None
        if lp is not None and lp.style in ("dense", "sparse"):
            item = lp.project_item(item)
        out[name] = item
    return out
