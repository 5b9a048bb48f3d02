"""Routed inner products of captured gradients; every mode is exact, only the cost differs.

The ops ask each layer's rule for the maths and the cost model; they never switch on layer
types themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.layer_gradient import Factorized, LayerGradient, Materialized, Shared
from dattri_llm.gradient.layers.shared import cross_site_per_token

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import Gradient

__all__ = [
    "dot",
    "pairwise_dot",
    "cross_dot",
    "cross_dot_per_token",
    "grad_norm_sq",
    "materialize",
    "layer_cross_dot",
    "layer_cross_dot_per_token",
]

_MODES = ("auto", "factorized", "materialized")


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


def _sites(lg: LayerGradient) -> list[Factorized | Materialized]:
    return list(lg.sites) if isinstance(lg, Shared) else [lg]


class _Dense:
    """Materialise each site at most once per op call (a self-Gram shares its two sides)."""

    def __init__(self) -> None:
        self._memo: dict[int, torch.Tensor] = {}

    def __call__(self, site: Factorized | Materialized) -> torch.Tensor:
        if isinstance(site, Materialized):
            return site.data
        key = id(site)
        if key not in self._memo:
            self._memo[key] = site.materialize().data
        return self._memo[key]


def _site_cross(
    x: Factorized | Materialized, y: Factorized | Materialized, mode: str, dense: _Dense
) -> torch.Tensor:
    if isinstance(x, Materialized) and isinstance(y, Materialized):
        return x.data @ y.data.T
    if isinstance(x, Materialized):
        return _site_cross(y, x, mode, dense).T
    rule = x.rule
    if isinstance(y, Materialized):
        if mode == "materialized" or (
            mode == "auto"
            and rule.prefer_materialized_against_dense(
                x.batch_size, y.batch_size, x.num_tokens, x.module_kwargs
            )
        ):
            return dense(x) @ y.data.T
        return rule.dense_cross(x.a, x.g, y.data, x.module_kwargs)
    if x.layer_type != y.layer_type:
        if mode == "materialized":
            return dense(x) @ dense(y).T
        return cross_site_per_token(
            rule, x.a, x.g, x.module_kwargs, y.rule, y.a, y.g, y.module_kwargs
        ).sum(1)
    if mode == "materialized" or (
        mode == "auto"
        and rule.prefer_materialized_gram(
            x.batch_size, y.batch_size, x.num_tokens, y.num_tokens, x.module_kwargs
        )
    ):
        return dense(x) @ dense(y).T
    return rule.gram(x.a, x.g, y.a, y.g, x.module_kwargs)


def layer_cross_dot(x: LayerGradient, y: LayerGradient, mode: str = "auto") -> torch.Tensor:
    """``(B1, B2)`` inner products of one layer's per-sample gradients."""
    _check_mode(mode)
    if mode == "materialized" and (isinstance(x, Shared) or isinstance(y, Shared)):
        # one dense sum per side and one GEMM, rather than a GEMM per pair of sites
        return x.materialize().data @ y.materialize().data.T
    dense = _Dense()
    total = None
    for xi in _sites(x):
        for yj in _sites(y):
            part = _site_cross(xi, yj, mode, dense)
            total = part if total is None else total + part
    assert total is not None
    return total


def _site_cross_per_token(
    x: Factorized | Materialized, y: Factorized | Materialized, mode: str
) -> torch.Tensor:
    if isinstance(x, Materialized):
        raise ValueError(
            f"layer of type {x.layer_type} was captured materialized: it has no token axis. "
            "Capture the train side with capture_style='factorized' for token granularity."
        )
    rule = x.rule
    if isinstance(y, Materialized):
        return rule.dense_per_token(x.a, x.g, y.data, x.module_kwargs)
    if x.layer_type != y.layer_type:
        return cross_site_per_token(
            rule, x.a, x.g, x.module_kwargs, y.rule, y.a, y.g, y.module_kwargs
        )
    if mode == "materialized" or (
        mode == "auto"
        and rule.prefer_materialized_gram(
            x.batch_size, y.batch_size, x.num_tokens, y.num_tokens, x.module_kwargs
        )
    ):
        return rule.dense_per_token(x.a, x.g, y.materialize().data, x.module_kwargs)
    return rule.gram_per_token(x.a, x.g, y.a, y.g, x.module_kwargs)


def layer_cross_dot_per_token(
    x: LayerGradient, y: LayerGradient, mode: str = "auto"
) -> torch.Tensor:
    """``(B1, T1, B2)`` per-token contributions of the left side's token positions."""
    _check_mode(mode)
    total = None
    for xi in _sites(x):
        for yj in _sites(y):
            part = _site_cross_per_token(xi, yj, mode)
            if total is not None and part.shape[1] != total.shape[1]:
                raise ValueError(
                    "sites of a shared parameter have different token counts "
                    f"({total.shape[1]} vs {part.shape[1]}); token granularity needs them equal."
                )
            total = part if total is None else total + part
    assert total is not None
    return total


def _paired(x: Gradient, y: Gradient) -> list[str]:
    if x.layer_names != y.layer_names:
        if set(x.layer_names) != set(y.layer_names):
            only_x = sorted(set(x.layer_names) - set(y.layer_names))
            only_y = sorted(set(y.layer_names) - set(x.layer_names))
            raise ValueError(
                "the two gradients were captured on different layers: only in the first: "
                f"{only_x}; only in the second: {only_y}. Capture both with the same hook config."
            )
    return x.layer_names


def cross_dot(
    x: Gradient, y: Gradient, mode: str = "auto", per_layer: bool = False
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Gram block ``(B1, B2)`` between two captures of the same layers.

    Args:
        x: Left capture.
        y: Right capture.
        mode: ``"auto"``, ``"factorized"`` or ``"materialized"``.
        per_layer: Return ``{layer: (B1, B2)}`` instead of the sum over layers.
    """
    names = _paired(x, y)
    parts = {n: layer_cross_dot(x.layers[n], y.layers[n], mode) for n in names}
    return parts if per_layer else sum(parts.values())


def cross_dot_per_token(
    x: Gradient, y: Gradient, mode: str = "auto", per_layer: bool = False
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Per-token contributions ``(B1, T1, B2)`` of ``x``'s positions; sums to :func:`cross_dot`.

    Every layer of ``x`` must be factorised and share one token count ``T1``.
    """
    names = _paired(x, y)
    parts = {n: layer_cross_dot_per_token(x.layers[n], y.layers[n], mode) for n in names}
    if per_layer:
        return parts
    lengths = {n: p.shape[1] for n, p in parts.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"layers have different token counts {lengths}; token granularity needs one token "
            "axis: select layers that see the sequence (hook_config) or capture them separately."
        )
    return sum(parts.values())


def pairwise_dot(x: Gradient, mode: str = "auto") -> torch.Tensor:
    """Gram matrix ``(B, B)`` of one capture."""
    return cross_dot(x, x, mode=mode)


def grad_norm_sq(x: Gradient, mode: str = "auto") -> torch.Tensor:
    """Squared norms ``(B,)`` of the per-sample gradients (summed over layers)."""
    _check_mode(mode)
    total = None
    for lg in x.layers.values():
        if isinstance(lg, Materialized):
            part = lg.data.pow(2).sum(-1)
        elif isinstance(lg, Shared):
            if mode == "factorized":
                part = torch.diagonal(layer_cross_dot(lg, lg, mode))
            else:
                part = lg.materialize().data.pow(2).sum(-1)
        else:
            rule = lg.rule
            if mode == "materialized" or (
                mode == "auto" and rule.prefer_materialized_norm(lg.num_tokens, lg.module_kwargs)
            ):
                part = lg.materialize().data.pow(2).sum(-1)
            else:
                part = rule.norm_sq(lg.a, lg.g, lg.module_kwargs)
        total = part if total is None else total + part
    assert total is not None
    return total


def dot(x: Gradient, y: Gradient, mode: str = "auto") -> torch.Tensor:
    """Per-sample inner products ``<x_i, y_i>`` ``(B,)`` of two captures of the same batch."""
    if x.batch_size != y.batch_size:
        raise ValueError(f"dot needs equal batch sizes, got {x.batch_size} and {y.batch_size}")
    rows = [
        torch.diagonal(cross_dot(x.slice([i]), y.slice([i]), mode=mode))
        for i in range(x.batch_size)
    ]
    return torch.cat(rows)


def materialize(x: Gradient) -> Gradient:
    """Every layer as a dense ``(B, P)`` per-sample gradient."""
    return x.materialize()
