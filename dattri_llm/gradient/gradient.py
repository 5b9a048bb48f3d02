"""The gradient data model: per-layer factorised or materialised per-sample gradients.

* :class:`Factorized` — a layer's factors ``a`` (input side) and ``g`` (output-gradient side),
  with a token axis, plus the ``module_kwargs`` that interpret them.
* :class:`Materialized` — the dense per-sample gradient ``(B, P)`` in the layer's matrix form.
* :class:`Shared` — one parameter used at several sites (tied weights); its gradient is the sum
  of its sites'.
* :class:`Gradient` — one captured step: ``{layer name: one of the above}``.
* :class:`GradientRecord` — ``(step, hashes, gradient)``, what callbacks and stores receive.
* :class:`GradientBlock` — ``(step, gradient, hashes)`` carrying ``checkpoint`` and ``metadata``,
  what gradient sources yield.

The per-layer classes live in :mod:`dattri_llm.gradient.layer_gradient` and are re-exported here.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.layer_gradient import (
    Factorized,
    LayerGradient,
    Materialized,
    Shared,
    concat_layer,
)
from dattri_llm.gradient.layer_inner import cross_gram, norm_sq

if TYPE_CHECKING:
    from dattri_llm.options import RoutingMode, SimilarityMetric

__all__ = [
    "Factorized",
    "Materialized",
    "Shared",
    "LayerGradient",
    "Gradient",
    "GradientRecord",
    "GradientBlock",
]


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
        return Gradient({n: concat_layer([g.layers[n] for g in grads]) for n in names})

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
            metric: ``"dot"`` or ``"cosine"`` (alias ``"cos"``).
            mode: ``"auto"`` (cost model), ``"factorized"`` or ``"materialized"``; all exact.

        Returns:
            ``(B_self, B_other)``.
        """
        from dattri_llm.options import similarity_metric

        metric = similarity_metric(metric)
        gram = cross_gram(self.layers, other.layers, mode=mode)
        if metric == "dot":
            return gram
        n1 = norm_sq(self.layers, mode=mode).clamp_min(0).sqrt()
        n2 = norm_sq(other.layers, mode=mode).clamp_min(0).sqrt()
        return gram / (n1[:, None] * n2[None, :]).clamp_min(torch.finfo(gram.dtype).tiny)


@dataclass
class GradientRecord:
    """One step as callbacks and stores see it.

    Attributes:
        step: Step index (one per backward pass, counted by the hook manager).
        hashes: One content hash (or sample id) per sample, in batch order.
        gradient: The per-sample gradients.
        checkpoint: Which model state the step was captured at (for TracIn pairing).
        metadata: JSON-serialisable facts about the step that scoring needs (e.g. the learning
            rate and the optimizer's step count of a preconditioned capture); stores keep it.
    """

    step: int
    hashes: list[str]
    gradient: Gradient
    checkpoint: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)


#: The metadata of a block that carries none (read-only).
NO_METADATA: Mapping[str, Any] = MappingProxyType({})


class GradientBlock(tuple):
    """One block of per-sample gradients, as a :class:`~dattri_llm.GradientSource` yields it.

    It *is* the specification's triple: ``for step, gradient, hashes in source`` unpacks it,
    ``block[:3]`` and ``len(block) == 3`` hold. The model state and the capture facts ride along
    as attributes (``block.checkpoint``, ``block.metadata``), so the library's richer blocks
    never break a loop written against the specification.

    Attributes:
        step: Step index of the block (record step on disk, checkpoint index when live).
        gradient: Per-sample gradients of the block's samples.
        hashes: One sample identity per row of ``gradient``.
        checkpoint: Model state the block was captured at (pairs train and test blocks).
        metadata: What the capture recorded about the step (read-only; e.g. the learning rate
            and optimizer step of a preconditioned capture, see :class:`GradientRecord`).
    """

    checkpoint: int
    metadata: Mapping[str, Any]

    def __new__(
        cls,
        step: int,
        gradient: Gradient,
        hashes: list[str],
        checkpoint: int = 0,
        metadata: Mapping[str, Any] = NO_METADATA,
    ) -> GradientBlock:
        """A block of ``(step, gradient, hashes)`` carrying ``checkpoint`` and ``metadata``."""
        self = super().__new__(cls, (step, gradient, hashes))
        # a tuple subclass cannot hold __slots__: the two extras live in the instance dict,
        # written past the read-only ``__setattr__`` below
        object.__setattr__(self, "checkpoint", checkpoint)
        object.__setattr__(self, "metadata", metadata)
        return self

    @property
    def step(self) -> int:
        """Step index of the block."""
        return self[0]

    @property
    def gradient(self) -> Gradient:
        """Per-sample gradients of the block's samples."""
        return self[1]

    @property
    def hashes(self) -> list[str]:
        """One sample identity per row of :attr:`gradient`."""
        return self[2]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"GradientBlock is immutable; use _replace({name}=...)")

    def _replace(self, **changes: Any) -> GradientBlock:
        """A copy with some of ``step``, ``gradient``, ``hashes``, ``checkpoint``, ``metadata``."""
        fields = dict(zip(("step", "gradient", "hashes"), self))
        fields.update(checkpoint=self.checkpoint, metadata=self.metadata)
        unknown = set(changes) - set(fields)
        if unknown:
            raise ValueError(f"GradientBlock has no fields {sorted(unknown)}")
        fields.update(changes)
        return GradientBlock(**fields)

    def __getnewargs__(self) -> tuple:
        return (*self, self.checkpoint, self.metadata)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GradientBlock):
            return (
                tuple.__eq__(self, other)
                and self.checkpoint == other.checkpoint
                and self.metadata == other.metadata
            )
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((tuple(self), self.checkpoint))

    def __repr__(self) -> str:
        return (
            f"GradientBlock(step={self[0]!r}, gradient={self[1]!r}, hashes={self[2]!r}, "
            f"checkpoint={self.checkpoint!r}, metadata={self.metadata!r})"
        )
