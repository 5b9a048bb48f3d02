"""The prepared test side of a score loop, and which of its layers to materialize once.

:class:`PreparedTest` is what :class:`~dattri_llm.attribution.base.BaseAttributor` prepares per
pairing key before the score loop (:mod:`dattri_llm.attribution.engine.scoring`) runs;
:func:`densify_test` decides, within ``AttributionArguments.score_memory_gb``, which test
layers are held dense instead of re-materialized for every train chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dattri_llm.gradient.gradient import Gradient, Materialized, Shared

if TYPE_CHECKING:
    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.compat import CaptureFacts

__all__ = ["PreparedTest", "densify_test"]

#: Share of ``score_memory_gb`` the densified test side may take.
_DENSE_TEST_SHARE = 0.5


class PreparedTest:
    """The prepared test gradients of one checkpoint, cut into column chunks."""

    def __init__(
        self,
        chunks: list[tuple[Gradient, torch.Tensor]],
        layers: list[str],
        dtype: torch.dtype,
        facts: CaptureFacts,
    ) -> None:
        self.chunks = chunks  # (gradient, global column indices)
        self.layers = layers
        self.dtype = dtype
        self.facts = facts  # what the test gradients were captured as

    @property
    def nbytes(self) -> int:
        """Bytes held by the prepared test gradients."""
        return sum(g.nbytes for g, _ in self.chunks)

    @property
    def num_rows(self) -> int:
        """Test rows (columns of the scores)."""
        return sum(int(c.numel()) for _, c in self.chunks)

    @property
    def dense(self) -> bool:
        """Whether every test layer is held materialized (none re-materialized per chunk)."""
        return all(
            isinstance(site, Materialized)
            for g, _ in self.chunks
            for lg in g.layers.values()
            for site in (lg.sites if isinstance(lg, Shared) else [lg])
        )


def densify_test(grad: Gradient, mode: str, args: AttributionArguments) -> Gradient:
    """Materialize, once, the test layers the router would materialize for every block.

    The routed inner products materialize both sides of a layer when that is cheaper;
    the test side is the same for every train block, so it is materialized here once
    instead of once per block. Holding such a layer dense only ever saves time (the chunk
    loop would form the same matrix for every chunk); what it costs is memory, so layers are
    materialized in order while the dense layers fit in half of ``args.score_memory_gb``
    (a layer left factorized is re-materialized for every train chunk). No cap relative to
    the factors' size: one at 4x (GPT-2 4x512's ``attn.c_proj``, 64 tokens: 4.004x) was
    re-formed for every 8-row chunk, 13 % of ``attribute()`` at 256 train x 32 queries.
    Exact either way.
    """
    if mode == "factorized":
        return grad
    room = args.score_memory_gb * 2**30 * _DENSE_TEST_SHARE - grad.nbytes
    b1 = min(args.per_device_train_batch_size, args.score_block_size)
    b2 = min(grad.batch_size, args.score_block_size)
    layers = {}
    for name, lg in grad.layers.items():
        sites = lg.sites if isinstance(lg, Shared) else [lg]
        if isinstance(lg, Materialized) or any(isinstance(x, Materialized) for x in sites):
            layers[name] = lg
            continue
        # a tied parameter is materialized as one dense sum when its largest site prefers
        # the materialized route: train sites then meet it as a dense matrix (one GEMM, or
        # an index gather for embedding sites) instead of re-materializing it per block
        big = max(sites, key=lambda x: x.nbytes)
        dense = mode == "materialized" or all(
            x.rule.prefer_materialized_gram(b1, b2, x.num_tokens, x.num_tokens, x.module_kwargs)
            for x in ([big] if isinstance(lg, Shared) else sites)
        )
        p = sites[0].rule.num_params(sites[0].module_kwargs)
        size = grad.batch_size * p * torch.finfo(grad.dtype).bits // 8
        if dense and size - lg.nbytes <= room:
            layers[name] = lg.materialize()
            room -= size - lg.nbytes
        else:
            layers[name] = lg
    return Gradient(layers)
