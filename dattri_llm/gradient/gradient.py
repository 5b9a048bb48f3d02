"""The gradient data model: per-layer factorised or materialised per-sample gradients.

* :class:`Factorized` — a layer's factors ``a`` (input side) and ``g`` (output-gradient side),
  with a token axis, plus the ``module_kwargs`` that interpret them.
* :class:`Materialized` — the dense per-sample gradient ``(B, P)`` in the layer's matrix form.
* :class:`Shared` — one parameter used at several sites (tied weights); its gradient is the sum
  of its sites'.
* :class:`Gradient` — one captured step: ``{layer name: one of the above}``.
* :class:`GradientRecord` — ``(step, hashes, gradient)``, what callbacks and stores receive.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

import torch

from dattri_llm.gradient.layers import LayerRule, get_rule

if TYPE_CHECKING:
    from dattri_llm.options import RoutingMode, SimilarityMetric

__all__ = ["Factorized", "Materialized", "Shared", "LayerGradient", "Gradient", "GradientRecord"]


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
        total = None
        for site in self.sites:
            d = site.materialize().data
            total = d if total is None else total + d
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


def _concat_layer(parts: Sequence[LayerGradient]) -> LayerGradient:
    first = parts[0]
    if isinstance(first, Shared) and all(
        isinstance(p, Shared) and len(p.sites) == len(first.sites) for p in parts
    ):
        sites = [_concat_layer([p.sites[i] for p in parts]) for i in range(len(first.sites))]
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


@dataclass
class Gradient:
    """One captured step: per-sample gradients of every hooked layer.

    Attributes:
        layers: ``{layer name: Factorized | Materialized | Shared}``, all with the same batch.
    """

    layers: dict[str, LayerGradient]

    def __post_init__(self) -> None:
        sizes = {n: lg.batch_size for n, lg in self.layers.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"layers disagree on the batch size: {sizes}")

    # ---- introspection -------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Number of samples in the step."""
        return next(iter(self.layers.values())).batch_size if self.layers else 0

    def __len__(self) -> int:
        return self.batch_size

    @property
    def layer_names(self) -> list[str]:
        """Layer names in capture order."""
        return list(self.layers)

    @property
    def layer_types(self) -> dict[str, str]:
        """``{layer name: layer type}``."""
        return {n: lg.layer_type for n, lg in self.layers.items()}

    @property
    def has_token_axis(self) -> dict[str, bool]:
        """``{layer name: whether a token axis survives}`` (factorised layers have one)."""
        return {n: not isinstance(lg, Materialized) for n, lg in self.layers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer."""
        return sum(lg.nbytes for lg in self.layers.values())

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the gradients."""
        lg = next(iter(self.layers.values()))
        while isinstance(lg, Shared):
            lg = lg.sites[0]
        return lg.g.dtype if isinstance(lg, Factorized) else lg.data.dtype

    @property
    def device(self) -> torch.device:
        """Device of the gradients."""
        lg = next(iter(self.layers.values()))
        while isinstance(lg, Shared):
            lg = lg.sites[0]
        return lg.g.device if isinstance(lg, Factorized) else lg.data.device

    # ---- transformations -------------------------------------------------------------------
    def materialize(self) -> Gradient:
        """Every layer as a dense ``(B, P)`` gradient."""
        return Gradient({n: lg.materialize() for n, lg in self.layers.items()})

    def flatten(self) -> torch.Tensor:
        """The concatenated dense per-sample gradient ``(B, sum P)`` over layers, in order."""
        return torch.cat([lg.materialize().data for lg in self.layers.values()], dim=1)

    def select_layers(self, names: Iterable[str]) -> Gradient:
        """Keep only the named layers (unknown names raise with the available ones)."""
        names = list(names)
        missing = [n for n in names if n not in self.layers]
        if missing:
            raise KeyError(f"layers {missing} not in the gradient; available: {self.layer_names}")
        return Gradient({n: self.layers[n] for n in names})

    def slice(self, idx: slice | Sequence[int] | torch.Tensor) -> Gradient:
        """Select samples (a slice, index list or boolean / index tensor)."""
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        return Gradient({n: lg.slice(idx) for n, lg in self.layers.items()})

    @staticmethod
    def concatenate(grads: Sequence[Gradient]) -> Gradient:
        """Join captures of the same layers along the batch axis.

        Factorised layers with different token counts are zero-padded (exact).
        """
        grads = list(grads)
        if not grads:
            raise ValueError("concatenate needs at least one Gradient")
        names = grads[0].layer_names
        for i, g in enumerate(grads[1:], 1):
            if g.layer_names != names:
                raise ValueError(
                    f"Gradient {i} has layers {g.layer_names}, expected {names} as in Gradient 0"
                )
        return Gradient({n: _concat_layer([g.layers[n] for g in grads]) for n in names})

    def aggregate(self) -> Gradient:
        """Sum over the batch: the batch gradient as a one-sample dense ``Gradient``."""
        return Gradient({n: lg.batch_sum() for n, lg in self.layers.items()})

    def apply(self, fn: callable) -> Gradient:
        """Apply ``fn`` to every floating tensor (integer index factors only move device)."""
        return Gradient({n: lg.apply(fn) for n, lg in self.layers.items()})

    def to(self, *args: object, **kwargs: object) -> Gradient:
        """``Tensor.to`` on every floating tensor (index factors keep their integer dtype)."""
        return self.apply(lambda t: t.to(*args, **kwargs))

    def clone(self) -> Gradient:
        """A deep copy of the tensors."""
        return Gradient(
            {n: copy.copy(lg).apply(lambda t: t.clone()) for n, lg in self.layers.items()}
        )

    def detach(self) -> Gradient:
        """Detached tensors."""
        return self.apply(lambda t: t.detach())

    def scale(self, factor: float | torch.Tensor) -> Gradient:
        """Multiply every per-sample gradient by ``factor`` (a scalar or a ``(B,)`` tensor)."""

        def one(lg: LayerGradient) -> LayerGradient:
            if isinstance(lg, Shared):
                return Shared([one(s) for s in lg.sites], list(lg.site_names))
            # a Python number is kept in float64 until cast to the gradient's dtype (as_tensor
            # would round it to the default float32 first)
            f = (
                factor
                if isinstance(factor, torch.Tensor)
                else torch.tensor(float(factor), dtype=torch.float64)
            )
            if isinstance(lg, Factorized):
                f = f.to(lg.g).reshape(-1, *([1] * (lg.g.dim() - 1))) if f.dim() else f.to(lg.g)
                return Factorized(lg.a, lg.g * f, lg.layer_type, lg.module_kwargs)
            f = f.to(lg.data).reshape(-1, 1) if f.dim() else f.to(lg.data)
            return Materialized(lg.data * f, lg.layer_type, lg.module_kwargs)

        return Gradient({n: one(lg) for n, lg in self.layers.items()})

    def similarity(
        self,
        other: Gradient,
        metric: SimilarityMetric = "dot",
        mode: RoutingMode = "auto",
    ) -> torch.Tensor:
        """Inner products (or cosines) between every sample of ``self`` and of ``other``.

        Args:
            other: A capture of the same layers.
            metric: ``"dot"`` or ``"cosine"``.
            mode: ``"auto"`` (cost model), ``"factorized"`` or ``"materialized"``; all exact.

        Returns:
            ``(B_self, B_other)``.
        """
        from dattri_llm.gradient import ops

        gram = ops.cross_dot(self, other, mode=mode)
        if metric == "dot":
            return gram
        if metric == "cosine":
            n1 = ops.grad_norm_sq(self, mode=mode).clamp_min(0).sqrt()
            n2 = ops.grad_norm_sq(other, mode=mode).clamp_min(0).sqrt()
            return gram / (n1[:, None] * n2[None, :]).clamp_min(torch.finfo(gram.dtype).tiny)
        raise ValueError(f"metric must be 'dot' or 'cosine', got {metric!r}")


@dataclass
class GradientRecord:
    """One step as callbacks and stores see it.

    Attributes:
        step: Step index (one per backward pass, counted by the hook manager).
        hashes: One content hash (or sample id) per sample, in batch order.
        gradient: The per-sample gradients.
        checkpoint: Which model state the step was captured at (for TracIn pairing).
    """

    step: int
    hashes: list[str]
    gradient: Gradient
    checkpoint: int = 0
