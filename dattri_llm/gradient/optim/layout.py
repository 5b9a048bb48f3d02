"""Per-parameter tensors laid out like a hooked layer's captured gradient.

A captured layer gradient lives in the layer rule's *matrix form* (``(K, D)`` flattened, bias
as a last column, see :mod:`dattri_llm.gradient.layers.base`), possibly reduced to the seeded
coordinates of a ``"mask"`` projection. Optimizer moments, parameter values and per-parameter
hyper-parameters (learning rate, betas, ...) are per *parameter*; :class:`LayerLayout` maps them
onto exactly the captured coordinates, so maps such as Adam's update direction are elementwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["LayerLayout", "layer_layouts", "refuse_mixing_layouts"]


class LayerLayout:
    """The parameters of one captured layer and where their entries sit in its gradient.

    Args:
        name: The layer's name in captured gradients (a tied group's lead site).
        params: ``{parameter name: parameter}`` (``HookManager.layer_parameters()``).
        rule: The layer's rule; ``kw`` its hyper-parameters.
        projection: The layer's capture-time projection (``LayerProjection``) or ``None``.

    Attributes:
        params: ``[(parameter name, nn.Parameter)]`` in matrix-form order.
        indices: The captured coordinates of a ``"mask"`` projection (``None``: all of them).
        dense_projection: The layer is captured with a ``"dense"`` projection (a map that needs
            exact entries runs before it).
    """

    def __init__(
        self,
        name: str,
        params: Mapping[str, torch.Tensor],
        rule: Any,
        kw: dict,
        projection: Any,
    ) -> None:
        self.name = name
        self.rule, self.kw = rule, kw
        names = rule.param_names(kw)
        missing = [n for n in names if not isinstance(params.get(n), torch.Tensor)]
        if missing:
            raise ValueError(
                f"layer {name!r}: its rule expects parameters {names}, but the module has no "
                f"{missing}; relabel the layer with a matching layer_types entry."
            )
        self.params: list[tuple[str, nn.Parameter]] = [(n, params[n]) for n in names]
        self.positions = rule.matrix_positions(kw)
        self.num_coords = rule.num_params(kw)
        self.indices: torch.Tensor | None = None
        self.dense_projection = False
        if projection is not None:
            if projection.style == "mask":
                self.indices = projection.matrices()["indices"]
                self.num_coords = int(self.indices.numel())
            elif projection.style in ("dense", "sparse"):
                self.dense_projection = True
            else:
                raise ValueError(
                    f"layer {name!r} is captured with a {projection.style!r} projection, which "
                    "mixes coordinates: per-coordinate optimizer quantities cannot be laid out "
                    "on it. Use no projection, or 'mask' (or 'dense' / 'sparse' for preconditioned "
                    "capture)."
                )

    def gather(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``{param name: param-shaped tensor}`` -> the captured coordinates ``(P,)``."""
        flat = self.rule.flatten_parameters(dict(tensors), self.kw, self.positions)
        if self.indices is not None:
            flat = flat[self.indices.to(flat.device)]
        return flat

    def scatter(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`gather` for ``(R, P)`` rows: ``{param name: (R, *param.shape)}``.

        Coordinates outside a mask are zero.
        """
        if self.indices is None:
            flat = rows
        else:
            flat = rows.new_zeros(rows.shape[0], self.rule.num_params(self.kw))
            flat[:, self.indices.to(rows.device)] = rows
        return {
            n: flat[:, self.positions[n].reshape(-1).to(rows.device)].reshape(
                rows.shape[0], *p.shape
            )
            for n, p in self.params
        }

    def expand(
        self, values: Mapping[str, float], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """One number per parameter -> one per captured coordinate ``(P,)``."""
        tensors = {
            n: torch.full(p.shape, float(values[n]), dtype=dtype, device=device)
            for n, p in self.params
        }
        return self.gather(tensors)


def layer_layouts(manager: CaptureHost) -> dict[str, LayerLayout]:
    """``{layer name: LayerLayout}`` for the ``linear_io`` layers of a hook manager.

    A tied group is one entry under its lead name (the parameter is one parameter).
    """
    by_name = {s.name: s for s in manager.layers}
    groups = manager.shared_groups
    out: dict[str, LayerLayout] = {}
    for name, params in manager.layer_parameters().items():
        spec = by_name[groups[name][0]] if name in groups else by_name[name]
        if spec.hook_type != "linear_io":
            continue
        projection = manager.projection[name] if manager.projection is not None else None
        out[name] = LayerLayout(name, params, spec.rule, spec.module_kwargs, projection)
    return out


def refuse_mixing_layouts(layouts: Mapping[str, LayerLayout], where: str, needs: str) -> None:
    """Refuse layers captured with a ``"dense"`` / ``"sparse"`` projection (it mixes coordinates).

    Args:
        layouts: The captured layers' layouts.
        where: Who refuses (the start of the message).
        needs: What is per coordinate, e.g. ``"optimizer moments"``.

    Raises:
        ValueError: naming the layers and the fix.
    """
    mixed = [n for n, lay in layouts.items() if lay.dense_projection]
    if mixed:
        raise ValueError(
            f"{where}: layers {mixed} use a 'dense' / 'sparse' projection, which mixes "
            f"coordinates; {needs} are per coordinate. Use no projection or a 'mask' projection."
        )
