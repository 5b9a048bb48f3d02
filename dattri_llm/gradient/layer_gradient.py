"""Per-layer gradient data model: factorised, materialised or shared (tied) per-sample gradients.

* :class:`Factorized` — a layer's factors ``a`` (input side) and ``g`` (output-gradient side),
  with a token axis, plus the ``module_kwargs`` that interpret them.
* :class:`Materialized` — the dense per-sample gradient ``(B, P)`` in the layer's matrix form.
* :class:`Shared` — one parameter used at several sites (tied weights); its gradient is the sum
  of its sites'.

:mod:`dattri_llm.gradient.gradient` assembles them into a step's :class:`Gradient`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from dattri_llm.gradient.layers import LayerRule, get_rule

__all__ = ["Factorized", "Materialized", "Shared", "LayerGradient", "concat_layer"]


def _index(x: torch.Tensor, idx: slice | Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(idx, slice):
        return x[idx]
    return x[torch.as_tensor(idx, dtype=torch.long, device=x.device)]


@dataclass
class Factorized:
    """A layer's per-sample gradients as factors.

    Attributes:
        a: Input-side factor ``(B, T, D)`` (token indices ``(B, T)`` for embeddings).
        g: Output-gradient factor ``(B, T, K)``.
        layer_type: Registered rule name (e.g. ``"nn.Linear"``).
        module_kwargs: Layer hyper-parameters the rule needs.
    """

    a: torch.Tensor
    g: torch.Tensor
    layer_type: str
    module_kwargs: dict = field(default_factory=dict)

    @property
    def rule(self) -> LayerRule:
        """The layer rule that interprets the factors."""
        return get_rule(self.layer_type)

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return int(self.g.shape[0])

    @property
    def num_tokens(self) -> int:
        """Length ``T`` of the token axis."""
        return int(self.g.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the factors."""
        return self.a.numel() * self.a.element_size() + self.g.numel() * self.g.element_size()

    def materialize(self) -> Materialized:
        """Contract the factors into the dense per-sample gradient."""
        dense = self.rule.materialize(self.a, self.g, self.module_kwargs)
        return Materialized(dense, self.layer_type, self.module_kwargs)

    def slice(self, idx: slice | Sequence[int] | torch.Tensor) -> Factorized:
        """Select samples."""
        return Factorized(
            _index(self.a, idx), _index(self.g, idx), self.layer_type, self.module_kwargs
        )

    def batch_sum(self) -> Materialized:
        """Sum over samples as a one-sample dense gradient, in one contraction.

        The gradient is additive over tokens, so one "sample" holding every sample's tokens
        gives the batch sum without forming a dense gradient per sample.
        """
        rule, b = self.rule, self.batch_size
        a = rule.concat_tokens([self.a[i : i + 1] for i in range(b)])
        g = rule.concat_tokens([self.g[i : i + 1] for i in range(b)])
        dense = rule.materialize(a, g, self.module_kwargs)
        return Materialized(dense, self.layer_type, self.module_kwargs)

    def apply(self, fn: callable) -> Factorized:
        """Apply ``fn`` to both factors (device / dtype moves, cloning)."""
        a = fn(self.a) if self.a.is_floating_point() else _move_int(self.a, fn)
        return Factorized(a, fn(self.g), self.layer_type, self.module_kwargs)

    def pad_tokens(self, length: int) -> Factorized:
        """Pad the token axis to ``length`` with zero contributions."""
        rule = self.rule
        return Factorized(
            rule.pad_tokens(self.a, length, True),
            rule.pad_tokens(self.g, length, False),
            self.layer_type,
            self.module_kwargs,
        )


def _move_int(x: torch.Tensor, fn: callable) -> torch.Tensor:
    """Move an integer tensor with ``fn`` without letting a dtype cast touch it."""
    probe = fn(torch.zeros((), dtype=torch.float32, device=x.device))
    return x if probe.device == x.device else x.to(probe.device)


@dataclass
class Materialized:
    """A layer's dense per-sample gradients ``(B, P)`` in the rule's matrix form."""

    data: torch.Tensor
    layer_type: str
    module_kwargs: dict = field(default_factory=dict)

    @property
    def rule(self) -> LayerRule:
        """The layer rule of the layer."""
        return get_rule(self.layer_type)

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self.data.numel() * self.data.element_size()

    def materialize(self) -> Materialized:
        """Already dense: returns itself."""
        return self

    def slice(self, idx: slice | Sequence[int] | torch.Tensor) -> Materialized:
        """Select samples."""
        return Materialized(_index(self.data, idx), self.layer_type, self.module_kwargs)

    def batch_sum(self) -> Materialized:
        """Sum over samples as a one-sample dense gradient."""
        return Materialized(self.data.sum(0, keepdim=True), self.layer_type, self.module_kwargs)

    def apply(self, fn: callable) -> Materialized:
        """Apply ``fn`` to the data."""
        return Materialized(fn(self.data), self.layer_type, self.module_kwargs)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Per-sample gradients in the parameters' own shapes: ``{name: (B, *shape)}``."""
        return self.rule.unflatten(self.data, self.module_kwargs)


@dataclass
class Shared:
    """A parameter used at several sites; its per-sample gradient is the sum over ``sites``.

    Attributes:
        sites: The factorised (or dense) gradient of each site.
        site_names: Module names of the sites, in the same order.
    """

    sites: list[Factorized | Materialized]
    site_names: list[str]

    @property
    def layer_type(self) -> str:
        """The first site's layer type (the matrix form every site shares)."""
        return self.sites[0].layer_type

    @property
    def module_kwargs(self) -> dict:
        """The first site's hyper-parameters."""
        return self.sites[0].module_kwargs

    @property
    def rule(self) -> LayerRule:
        """The first site's rule."""
        return self.sites[0].rule

    @property
    def batch_size(self) -> int:
        """Number of samples ``B``."""
        return self.sites[0].batch_size

    @property
    def nbytes(self) -> int:
        """Bytes held by every site."""
        return sum(s.nbytes for s in self.sites)

    def materialize(self) -> Materialized:
        """Sum of the sites' dense gradients."""
        total, owned = None, False
        for site in self.sites:
            d = site.materialize().data
            if total is None:
                total, owned = d, not isinstance(site, Materialized)  # else: the site's data
            elif owned and d.dtype == total.dtype and d.shape == total.shape:
                total.add_(d)  # in place: a tied embedding's sum holds two dense buffers, not 3
            else:
                total, owned = total + d, True
        assert total is not None
        return Materialized(total, self.layer_type, self.module_kwargs)

    def slice(self, idx: slice | Sequence[int] | torch.Tensor) -> Shared:
        """Select samples."""
        return Shared([s.slice(idx) for s in self.sites], list(self.site_names))

    def batch_sum(self) -> Materialized:
        """Sum over samples (and sites) as a one-sample dense gradient."""
        total = sum(site.batch_sum().data for site in self.sites)
        return Materialized(total, self.layer_type, self.module_kwargs)

    def apply(self, fn: callable) -> Shared:
        """Apply ``fn`` to every site."""
        return Shared([s.apply(fn) for s in self.sites], list(self.site_names))


LayerGradient = Union[Factorized, Materialized, Shared]  # noqa: UP007 (runtime alias, py3.10)


def concat_layer(parts: Sequence[LayerGradient]) -> LayerGradient:
    """Join one layer's captures along the batch axis (factors zero-padded to a common length)."""
    first = parts[0]
    if isinstance(first, Shared) and all(
        isinstance(p, Shared) and len(p.sites) == len(first.sites) for p in parts
    ):
        sites = [concat_layer([p.sites[i] for p in parts]) for i in range(len(first.sites))]
        return Shared(sites, list(first.site_names))
    if all(isinstance(p, Factorized) for p in parts):
        length = max(p.num_tokens for p in parts)
        padded = [p.pad_tokens(length) for p in parts]
        return Factorized(
            torch.cat([p.a for p in padded]),
            torch.cat([p.g for p in padded]),
            first.layer_type,
            first.module_kwargs,
        )
    dense = [p.materialize().data for p in parts]
    return Materialized(torch.cat(dense), first.layer_type, first.module_kwargs)
