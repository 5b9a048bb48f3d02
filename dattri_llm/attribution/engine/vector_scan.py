"""The score loop's fast path over a vector store: contiguous blocks, one product per block.

When every selected layer of a train store is one fixed-size vector per sample (the ``dense`` /
``mask`` / ``sparse`` projections, ``logra`` written as its dense projected gradient, any
materialized layer), scoring is a matrix product and its speed is set by two limits: the
product itself and reading the bytes. :func:`run_vector_scan` feeds the product large blocks
read by :class:`~dattri_llm.gradient.store.vector_reader.VectorBlockReader` (each shard's
tensors ``readinto`` preallocated per-layer buffers, no ``Gradient`` per record) instead of
one ``load_record`` per record joined into chunks.

The maths is the general loop's: the attributor's ``prepare_train`` (Grad-Cos normalization,
TracIn's checkpoint weight) and ``score_block`` on the block, the test side prepared by the
general code, the rows handed to the same sink. A block never mixes checkpoint labels, so the
checkpoint weight and the pairing are those of every row in it.

:func:`vector_units` says when the path applies (the caller also checks that the attributor
keeps the base class's pairing, block weight and block checks). ``ENABLED = False`` turns it
off (benchmarks and tests compare both paths).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.gradient import Gradient, GradientBlock, Materialized
from dattri_llm.gradient.store.vector_reader import (
    VectorBlockReader,
    VectorLayer,
    read_ahead,
    record_widths,
    store_vector_layers,
)

if TYPE_CHECKING:
    from dattri_llm.attribution.engine.blocks import Accumulator
    from dattri_llm.attribution.engine.prepared import PreparedTest
    from dattri_llm.attribution.engine.protocol import ScoringMethod
    from dattri_llm.attribution.engine.units import RecordSource

__all__ = ["ENABLED", "vector_units", "run_vector_scan", "block_rows"]

#: Use the fast path where it applies (``False``: always the general loop).
ENABLED = True
#: Read the next blocks on a thread while a block is scored (file reads, CRC-32 and the
#: products release the GIL); ``False``: read and score in turn.
READ_AHEAD = True
#: Bytes of train vectors per block (all layers, counted at 8 bytes a number); three blocks'
#: buffers are held (one scored, one queued, one being read).
_BLOCK_BYTES = 32 * 2**20


def vector_units(units: RecordSource | None) -> list[VectorLayer] | None:
    """The selected layers if the fast path can read ``units``, else ``None``.

    It can when every record is read whole and every selected layer is a plain materialized
    tensor, with the same layer types and hyper-parameters, in every distinct schema.
    """
    if not ENABLED or units is None or not units.units:
        return None
    if any(u.rows is not None for u in units.units):
        return None
    return store_vector_layers(units.store, [u.index for u in units.units], units.layers)


def block_rows(layers: list[VectorLayer], units: RecordSource, args: Any, num_cols: int) -> int:
    """Rows per block: ``_BLOCK_BYTES`` of vectors, within ``args.score_memory_gb``."""
    width = sum(record_widths(units.store, units.units[0].index, layers).values())
    per_row = max(1, width) * 8 * 3 + 2 * num_cols * 8  # buffer, cast, normalized; score row
    budget = int(args.score_memory_gb * 2**30) // per_row
    return int(max(1, min(budget, _BLOCK_BYTES // (max(1, width) * 8))))


def run_vector_scan(
    att: ScoringMethod,
    units: RecordSource,
    layers: list[VectorLayer],
    tests: dict[int, PreparedTest],
    num_cols: int,
    acc: Accumulator,
    bar: Any = None,
) -> None:
    """Score every record of ``units`` (in order) against its test side into ``acc``'s sink."""
    from dattri_llm.attribution.engine.scoring import ScoreLoop

    loop = ScoreLoop(att, tests, num_cols, acc)  # its pairing rule and error
    rows = block_rows(layers, units, att.args, num_cols)
    reader = VectorBlockReader(units.store, layers, units.dtype, rows, slots=3)
    names = {v.name for v in layers}
    checked: set[int] = set()
    blocks = reader.blocks([u.index for u in units.units])
    for block in read_ahead(blocks) if READ_AHEAD else blocks:
        ckpt = block.checkpoints[0]
        grad = Gradient(
            {
                v.name: Materialized(block.layers[v.name], v.layer_type, v.module_kwargs)
                for v in layers
            }
        )
        gb = GradientBlock(block.record_steps[0], grad, block.hashes, ckpt, block.metadata[0])
        test = loop.test_for(gb)
        if id(test) not in checked:
            if names != set(test.layers):
                te = set(test.layers)
                raise ValueError(
                    f"the test gradients were captured on layers {sorted(te)} but the train "
                    f"gradients on layers {sorted(names)} (only in train: {sorted(names - te)}; "
                    f"only in test: {sorted(te - names)}). Capture both with the same hook "
                    "config, or score a common subset (attribute_from_cache(..., layers=[...]))."
                )
            checked.add(id(test))
        acc.check_facts(att, gb, test)
        key = att.pairing_key(gb)
        for md, step in zip(block.metadata[1:], block.record_steps[1:]):
            # each record's weights fingerprint, as the general loop sees every block's
            acc.weights.see(SimpleNamespace(metadata=md, step=step, checkpoint=ckpt), key)
        dtype = torch.promote_types(grad.dtype, test.dtype)
        tr = att.prepare_train(grad.to(att.device, dtype), ckpt)
        n = block.num_rows
        out = torch.zeros(n, num_cols, dtype=dtype)
        for te, cols in test.chunks:
            s = att.score_block(tr, te.to(dtype), "sample").detach()
            out.index_add_(1, cols, s.to("cpu", dtype))
        del tr, grad, gb
        acc.add_rows(out, block.hashes, block.steps, block.checkpoints, None)
        if bar is not None:
            bar.update(n)
