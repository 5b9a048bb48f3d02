"""The score loop over train blocks: chunks sized from a memory budget, sinks, checkpoints.

:class:`ScoreLoop` is what :class:`~dattri_llm.attribution.base.BaseAttributor` runs once the
test side is prepared:

* **Chunks from a budget.** Consecutive train blocks that pair with the same test gradients
  (same pairing key and checkpoint) are joined into one chunk of at most ``rows`` rows and
  scored with one ``score_block`` call per test chunk: the (possibly dense) test side is read
  once per chunk instead of once per captured batch. The budget's rows are the largest count
  whose working set — the chunk's gradients (once: the blocks are freed layer by layer as
  they are joined), one layer of them materialized at a time, and the score rows — fits in
  ``AttributionArguments.score_memory_gb`` beside the prepared test side, capped by
  ``score_block_size``; blocks are joined while one layer of the chunk stays under 16 MiB
  dense, and a block larger than the budget's rows is scored in slices of that many rows.
* **Sinks.** Rows go to a :class:`~dattri_llm.attribution.engine.sinks.FullSink` (the full
  matrix) or a :class:`~dattri_llm.attribution.engine.sinks.TopKSink` (``top_k=``).
* **Checkpoints and progress.** Over a store (a
  :class:`~dattri_llm.attribution.engine.units.RecordSource`) the loop skips the records a
  checkpoint covers, checkpoints after every chunk (:mod:`dattri_llm.attribution.engine.resume`),
  and shows a bar over samples (rate and ETA).

Exactness: a chunk is the concatenation of its blocks (factorised layers with other token
counts are zero-padded, which adds nothing), every row's score is computed as it would be
alone, and a block's ``block_weight`` multiplies its score rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.engine import distributed
from dattri_llm.attribution.engine.blocks import check_hashes, check_token_axis, join_releasing
from dattri_llm.attribution.engine.sinks import TopKSink, top_k_of
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.gradient import Gradient, GradientBlock, Materialized, Shared

if TYPE_CHECKING:
    from dattri_llm.attribution.engine.blocks import Accumulator
    from dattri_llm.attribution.engine.prepared import PreparedTest
    from dattri_llm.attribution.engine.protocol import ScoringMethod
    from dattri_llm.attribution.engine.resume import ScoreCheckpoint
    from dattri_llm.attribution.engine.units import RecordSource

__all__ = ["ScoreLoop", "dense_row_bytes", "progress_bar", "final_result"]

#: Bytes of one layer's materialized chunk the row count aims under (see ``chunk_rows``).
_LAYER_BUFFER = 16 * 2**20
#: Test rows beyond this many times those rows make re-reading the dense test side per chunk
#: cost more than fresh pages for a larger chunk (measured: reading ~0.1 ms/MB, first-touch
#: pages ~0.25 ms/MB on the reference CPU).
_REREAD = 2.5
#: A test side partly left factorized re-materializes those layers for every chunk: chunks of
#: about as many rows as test columns once the test side has this many times the rows of a
#: captured block (and of the allocator-friendly chunk), while one layer of such a chunk stays
#: within ``_REMATERIALIZE_LAYER`` bytes. A heuristic between measured points on 4x256 / 4x512
#: GPT-2 (the floor rows of docs/benchmarks/scoring.md): 1024 x 64 (a 67 MB layer) 5.6x a plain
#: step -> 2.4-2.7x; 4x512 at 64 x 16 and 256 x 32, where larger chunks cost more in fresh
#: pages than they save (1.4x -> 2.4x and 2.0x -> 2.7x when tried; 134 MB at 256 x 32), keep
#: their chunks.
_REMATERIALIZE = 4
_REMATERIALIZE_LAYER = 96 * 2**20


def dense_row_bytes(grad: Gradient, itemsize: int) -> int:
    """Bytes of the largest single layer's dense per-sample gradient (one row)."""
    most = 0
    for lg in grad.layers.values():
        site = lg.sites[0] if isinstance(lg, Shared) else lg
        if isinstance(site, Materialized):
            p = int(site.data.shape[1])
        else:
            p = int(site.rule.num_params(site.module_kwargs))
        most = max(most, p)
    return most * itemsize


def progress_bar(show: bool | None, total: int | None, desc: str, initial: int = 0) -> Any:
    """A bar over samples (rate in samples/s and ETA), or ``None`` (see ``utils.progress``)."""
    from dattri_llm.utils import progress
    from dattri_llm.utils.distributed import get_rank, get_world_size

    if get_world_size() > 1:
        desc = f"{desc} [rank {get_rank()}]"
    return progress.progress_bar(
        show, total=total, initial=initial, desc=desc, unit="sample", unit_scale=True
    )


class ScoreLoop:
    """Score train blocks against prepared test sides into an accumulator.

    Args:
        attributor: The attributor (its extension points are called).
        tests: ``{pairing key: PreparedTest}``.
        num_cols: Test columns ``M``.
        acc: The accumulator (checks and sink).
    """

    def __init__(
        self,
        attributor: ScoringMethod,
        tests: dict[int, PreparedTest],
        num_cols: int,
        acc: Accumulator,
    ) -> None:
        self.att = attributor
        self.tests = tests
        self.num_cols = num_cols
        self.acc = acc
        self._rows: int | None = None
        self.chunks = 0

    # ---- pairing and sizes ----
    def test_for(self, block: GradientBlock) -> PreparedTest:
        """The test side a train block is scored against."""
        c = self.att.pairing_key(block)
        if c in self.tests:
            return self.tests[c]
        if len(self.tests) == 1:
            return next(iter(self.tests.values()))
        raise ValueError(
            f"train block at step {block.step} (checkpoint {block.checkpoint}) pairs with "
            f"test key {c}, but the test gradients exist at checkpoints {sorted(self.tests)} "
            "(pairing keys): capture the test set at every train checkpoint, or at a single one "
            "(it then pairs with all)."
        )

    def chunk_rows(self, block: GradientBlock) -> int:
        """Train rows per chunk from the memory budget (fixed at the first block)."""
        if self._rows is not None:
            return self._rows
        args = self.att.args
        cap = int(args.score_block_size)
        if self.acc.granularity == "token":
            self._rows = cap  # per-block token scores: blocks are not joined
            return cap
        test = self.test_for(block)
        dtype = torch.promote_types(block.gradient.dtype, test.dtype)
        itemsize = torch.finfo(dtype).bits // 8
        grad = block.gradient
        n = max(1, grad.batch_size)
        # the chunk's gradients once (its blocks are freed layer by layer as they are joined),
        # plus a copy when they are promoted to the test side's wider dtype
        scale = itemsize / (torch.finfo(grad.dtype).bits // 8)
        per_row = grad.nbytes / n * (1.0 + (scale if scale > 1 else 0.0))
        row_bytes = max(1, dense_row_bytes(grad, itemsize))
        per_row += row_bytes + 2 * self.num_cols * itemsize
        free = int(args.score_memory_gb * 2**30) - test.nbytes
        budget = int(max(1, min(cap, free // max(1.0, per_row))))
        # Joined blocks stay small enough for one layer of the chunk, materialized, to be
        # recycled by the allocator (fresh pages for every chunk cost more than re-reading a
        # small test side), unless the test side is large enough that its per-chunk cost
        # dominates: re-reading it when dense, re-materializing the layers the budget left
        # factorized otherwise (see _REMATERIALIZE). Then about as many rows as test columns
        # (measured: 4x256, 1024 x 64 at 4 GiB, 2.1x a plain step instead of 4.0x). A captured
        # block is never cut below what the budget allows.
        friendly = _LAYER_BUFFER // row_bytes
        want = friendly
        if test.num_rows > _REREAD * friendly and (
            test.dense
            or (
                test.num_rows >= _REMATERIALIZE * max(n, friendly)
                and test.num_rows * row_bytes <= _REMATERIALIZE_LAYER
            )
        ):
            want = max(friendly, test.num_rows)
        self._rows = max(min(budget, want), min(n, budget), 1)
        return self._rows

    # ---- running ----
    def run_blocks(self, blocks: Iterable[GradientBlock], bar: Any = None) -> None:
        """Score blocks from any source, joined into chunks."""
        for chunk, _ in self._chunks(blocks):
            self._flush(chunk, None, bar, 0)

    def run_units(
        self,
        source: RecordSource,
        checkpoint: ScoreCheckpoint | None = None,
        bar: Any = None,
        start: int = 0,
    ) -> None:
        """Score a store's records from ``start`` on, checkpointing after every chunk."""
        units = source.units
        blocks = (source.load(units[i]) for i in range(start, len(units)))
        for chunk, last in self._chunks(blocks, start):
            self._flush(chunk, checkpoint, bar, last + 1)
        if checkpoint is not None and checkpoint.units_done < len(units):
            checkpoint.save(self.acc.sink, len(units))

    def _flush(
        self, chunk: list[GradientBlock], checkpoint: Any, bar: Any, done_after: int
    ) -> None:
        rows = sum(b.gradient.batch_size for b in chunk)
        self.score_chunk(chunk)  # empties ``chunk`` as it joins it
        if checkpoint is not None:
            checkpoint.save(self.acc.sink, done_after)
        if bar is not None:
            bar.update(rows)

    def _chunks(
        self, blocks: Iterable[GradientBlock], start: int = 0
    ) -> Iterator[tuple[list[GradientBlock], int]]:
        """Join consecutive blocks with the same pairing into chunks of at most ``rows``.

        Yields each chunk with the index of its last block (counted from ``start``). A chunk
        is scored as soon as another block like its last one would not fit, rather than held
        while the next block is read (or, live, computed). Blocks are taken from a plain
        iterator, not an ``enumerate``/``zip`` tuple (those keep their last result alive).
        """
        pending: list[GradientBlock] = []
        key: Any = None
        last, size = -1, 0
        token = self.acc.granularity == "token"
        i = start - 1
        for block in blocks:
            i += 1
            k = (self.att.pairing_key(block), int(block.checkpoint))
            n, rows = block.gradient.batch_size, self.chunk_rows(block)
            if pending and (k != key or size + n > rows):
                yield pending, last
                pending, size = [], 0
            pending.append(block)
            del block  # held by ``pending`` alone, which the chunk's join empties
            key, last, size = k, i, size + n
            if token or size + n > rows:
                yield pending, last
                pending, size = [], 0
        if pending:
            yield pending, last

    # ---- one chunk ----
    def score_chunk(self, blocks: list[GradientBlock]) -> None:
        """Score consecutive blocks that pair with the same test side, as one chunk."""
        att, acc = self.att, self.acc
        test = self.test_for(blocks[0])
        weights: list[float] = []
        hashes: list[str] = []
        steps: list[int] = []
        ckpts: list[int] = []
        sizes: list[int] = []
        for block in blocks:
            check_hashes(block, "train")
            att.check_block(block, "train")
            names = block.gradient.layer_names
            if set(names) != set(test.layers):
                tr, te = set(names), set(test.layers)
                raise ValueError(
                    f"the test gradients were captured on layers {sorted(te)} but the train "
                    f"gradients on layers {sorted(tr)} (only in train: {sorted(tr - te)}; only "
                    f"in test: {sorted(te - tr)}). Capture both with the same hook config, or "
                    "score a common subset (attribute_from_cache(..., layers=[...]))."
                )
            acc.check_facts(att, block, test)
            if acc.granularity == "token":
                check_token_axis(block.gradient)
            weights.append(float(att.block_weight(block)))
            k = block.gradient.batch_size
            hashes += [str(h) for h in block.hashes]
            steps += [int(block.step)] * k
            ckpts += [int(block.checkpoint)] * k
            sizes.append(k)
        del block  # the loop's last block: the join frees the blocks' layers as it goes
        checkpoint = int(blocks[0].checkpoint)
        bs = max(self.chunk_rows(blocks[0]), 1)
        grad = join_releasing(blocks, test.layers)  # frees the blocks layer by layer
        dtype = torch.promote_types(grad.dtype, test.dtype)
        n = grad.batch_size
        out = torch.zeros(n, self.num_cols, dtype=dtype)
        tokens: list[torch.Tensor] = []
        for r0 in range(0, n, bs):
            rows = slice(r0, min(n, r0 + bs))
            tr = att.prepare_train(grad.slice(rows).to(att.device, dtype), checkpoint)
            tok = None
            for te, cols in test.chunks:
                s = att.score_block(tr, te.to(dtype), acc.granularity).detach()
                if acc.granularity == "token":
                    s = s.to("cpu", dtype)
                    if tok is None:
                        tok = torch.zeros(s.shape[0], s.shape[1], self.num_cols, dtype=dtype)
                    tok.index_add_(2, cols, s)
                    s = s.sum(1)
                out[rows].index_add_(1, cols, s.to("cpu", dtype))
            if tok is not None:
                tokens += list(tok.unbind(0))
            del tr
        if any(w != 1.0 for w in weights):
            row_w = torch.cat(
                [torch.full((k,), w, dtype=torch.float64) for k, w in zip(sizes, weights)]
            ).to(dtype)
            out *= row_w[:, None]
            tokens = [t * w for t, w in zip(tokens, row_w.tolist())]
        acc.add_rows(out, hashes, steps, ckpts, tokens if acc.granularity == "token" else None)
        self.chunks += 1


def final_result(
    sink: Any,
    columns: list[str],
    k: int | None,
    keys: Any,
    output_dir: str | None,
    split: bool = False,
) -> AttributionScore:
    """The sink's result: merged over ranks when scoring is split, reduced for ``top_k``.

    Split full matrices: rank 0 gets every row in store order, the other ranks their own
    rows. Split top-k: every rank gets the merged top-k.
    """
    if not split:
        score = sink.result(columns, output_dir)
        return score if k is None or score.top_k_kept else top_k_of(score, k)
    if isinstance(sink, TopKSink):
        sink.check_complete()
        merged = distributed.merge_top_k_states(sink.state(), {}, sink.duplicates)
        return merged.result(columns, output_dir)
    matrix = sink._matrix(len(columns))
    meta = {"hashes": sink.hashes, "steps": sink.steps, "checkpoints": sink.checkpoints}
    got = distributed.gather_full(matrix, meta, keys)
    if got is None:  # not rank 0: this rank's own rows
        if not sink.num_rows:
            return AttributionScore(torch.zeros(0, len(columns)), [], [], columns)
        score = sink.result(columns, output_dir)
        return score if k is None else top_k_of(score, k)
    full, meta = got
    score = AttributionScore(
        full,
        meta["hashes"],
        meta["steps"],
        columns,
        output_dir=output_dir,
        train_checkpoints=meta["checkpoints"],
        repeats=sink.repeats,
    )
    return score if k is None else top_k_of(score, k)
