"""Routed inner products of one layer's per-sample gradient forms, and their sums over layers.

Every mode is exact; only the cost differs. The maths and the cost model come from each
layer's rule: nothing here switches on layer types. This module works on the layer forms
(:class:`Factorized`, :class:`Materialized`, :class:`Shared`) and on ``{layer: form}``
mappings only, so that the container (:class:`~dattri_llm.gradient.gradient.Gradient`) can use
it without the two modules knowing each other; the container-level API is
:mod:`dattri_llm.gradient.ops.inner`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dattri_llm.gradient.layer_gradient import Factorized, LayerGradient, Materialized, Shared
from dattri_llm.gradient.layers.shared import cross_site_per_token

__all__ = [
    "check_mode",
    "layer_cross_dot",
    "layer_cross_dot_per_token",
    "layer_norm_sq",
    "paired_names",
    "cross_gram",
    "cross_gram_per_token",
    "norm_sq",
]

_MODES = ("auto", "factorized", "materialized")


def check_mode(mode: str) -> None:
    """Refuse a routing mode other than ``auto``, ``factorized`` or ``materialized``."""
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
    check_mode(mode)
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
            f"layer of type {x.layer_type} is materialized: it has no token axis. For token "
            "granularity write the train store with OffloadCallback(keep_token_factors=True) "
            "and capture it with capture_style='factorized'."
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
    check_mode(mode)
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


def paired_names(x: Mapping[str, LayerGradient], y: Mapping[str, LayerGradient]) -> list[str]:
    """The layers two captures share, in the left one's order; refuses different layer sets."""
    if list(x) != list(y) and set(x) != set(y):
        only_x = sorted(set(x) - set(y))
        only_y = sorted(set(y) - set(x))
        raise ValueError(
            "the two gradients were captured on different layers: only in the first: "
            f"{only_x}; only in the second: {only_y}. Capture both with the same hook config."
        )
    return list(x)


def cross_gram(
    x: Mapping[str, LayerGradient],
    y: Mapping[str, LayerGradient],
    mode: str = "auto",
    per_layer: bool = False,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``(B1, B2)`` inner products summed over the layers (``{layer: (B1, B2)}`` per layer)."""
    parts = {n: layer_cross_dot(x[n], y[n], mode) for n in paired_names(x, y)}
    return parts if per_layer else sum(parts.values())


def cross_gram_per_token(
    x: Mapping[str, LayerGradient],
    y: Mapping[str, LayerGradient],
    mode: str = "auto",
    per_layer: bool = False,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``(B1, T1, B2)`` per-token contributions of ``x``'s positions, summed over the layers."""
    parts = {n: layer_cross_dot_per_token(x[n], y[n], mode) for n in paired_names(x, y)}
    if per_layer:
        return parts
    lengths = {n: p.shape[1] for n, p in parts.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(
            f"layers have different token counts {lengths}; token granularity needs one token "
            "axis: select layers that see the sequence (hook_config) or capture them separately."
        )
    return sum(parts.values())


def layer_norm_sq(lg: LayerGradient, mode: str = "auto") -> torch.Tensor:
    """Squared norms ``(B,)`` of one layer's per-sample gradients."""
    if isinstance(lg, Materialized):
        return lg.data.pow(2).sum(-1)
    if isinstance(lg, Shared):
        if mode == "factorized":
            return torch.diagonal(layer_cross_dot(lg, lg, mode))
        return lg.materialize().data.pow(2).sum(-1)
    rule = lg.rule
    if mode == "materialized" or (
        mode == "auto" and rule.prefer_materialized_norm(lg.num_tokens, lg.module_kwargs)
    ):
        return lg.materialize().data.pow(2).sum(-1)
    return rule.norm_sq(lg.a, lg.g, lg.module_kwargs)


def norm_sq(layers: Mapping[str, LayerGradient], mode: str = "auto") -> torch.Tensor:
    """Squared norms ``(B,)`` of the per-sample gradients, summed over the layers."""
    check_mode(mode)
    total = None
    for lg in layers.values():
        part = layer_norm_sq(lg, mode)
        total = part if total is None else total + part
    assert total is not None
    return total
