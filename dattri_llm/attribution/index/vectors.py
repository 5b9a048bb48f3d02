"""Gradients as one vector per sample: the layers joined in a fixed order, rows aggregated.

A :class:`~dattri_llm.attribution.index.GradientIndex` searches fixed-size vectors, so every
layer it covers must be stored as one vector per sample (a ``Materialized`` layer: the
``dense`` / ``mask`` / ``sparse`` projections, a ``logra`` capture with
``capture_style="materialized"`` or ``"auto"``, or an unprojected materialized layer; a tied
layer whose sites are all materialized sums them). A factorized layer keeps per-token factors
whose size varies with the sequence and is refused (:class:`NotVectorError`).

The train side of the scores TracIn's ``top_k`` ranks is agnostic: a sample's rows (steps,
checkpoints, duplicated items) are summed. Inner products are linear, so summing a sample's
(prepared) row vectors once at build time gives exactly those sums:
``v(z) = sum_rows w_c * prep(row)`` with ``prep`` the identity (``"dot"``) or the division by
the row's norm (``"cosine"``, Grad-Cos), and ``w_c`` the checkpoint weights (TracIn).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dattri_llm.gradient.gradient import Gradient, Materialized, Shared
from dattri_llm.gradient.store.vector_reader import VectorBlockReader, store_vector_layers

__all__ = [
    "NotVectorError",
    "check_finite_vectors",
    "check_vector_schema",
    "block_vectors",
    "unit_rows",
    "PartVectors",
    "plan_parts",
    "train_parts",
    "query_vectors",
]


class NotVectorError(ValueError):
    """A layer is not stored as one fixed-size vector per sample (it cannot be indexed)."""


def _refusal(name: str, layer_type: str, where: str) -> NotVectorError:
    return NotVectorError(
        f"layer {name!r} ({layer_type}) of the {where} is stored factorized (per-token factors "
        "whose size varies with the sequence): a GradientIndex needs one fixed-size vector per "
        "sample and layer. Capture with a vector projection (HookManagerConfig(projection="
        "ProjectionConfig('dense' | 'mask' | 'sparse', proj_dim=...))), or with "
        "capture_style='materialized' so that each layer is stored as its "
        "(projected) per-sample gradient; or leave the layer out with layers=[...]."
    )


def check_vector_schema(schema: Sequence[Mapping[str, Any]], layers: Sequence[str], where: str):
    """Refuse, from a shard's layer schema, a selected layer that is stored factorized.

    Raises:
        NotVectorError: naming the first such layer and the fix.
    """
    for spec in schema:
        if spec["name"] not in layers:
            continue
        sites = spec["sites"] if spec["kind"] == "shared" else [spec]
        for site in sites:
            if site["kind"] != "materialized":
                raise _refusal(spec["name"], site["layer_type"], where)


def block_vectors(
    gradient: Gradient, layers: Sequence[str], where: str, materialize: bool = False
) -> torch.Tensor:
    """``(B, D)``: the selected layers' per-sample vectors joined in ``layers`` order.

    Args:
        gradient: The block's gradients.
        layers: The layers, in vector order.
        where: How errors name the gradients' origin.
        materialize: Materialize a factorized layer (the few queries of a search: their
            per-token factors become the vector the train side stores) instead of refusing it.

    Raises:
        NotVectorError: a selected layer is factorized (and ``materialize`` is off).
        KeyError: a selected layer is missing from the gradient.
    """
    parts = []
    for name in layers:
        if name not in gradient.layers:
            raise KeyError(
                f"layer {name!r} is not in the {where}; it holds {gradient.layer_names}."
            )
        lg = gradient.layers[name]
        sites = lg.sites if isinstance(lg, Shared) else [lg]
        for site in sites:
            if not materialize and not isinstance(site, Materialized):
                raise _refusal(name, site.layer_type, where)
        data = lg.materialize().data
        parts.append(data.reshape(data.shape[0], -1))
    return torch.cat(parts, dim=1)


def check_finite_vectors(vectors: np.ndarray, hashes: Sequence[str], side: str) -> None:
    """Refuse a non-finite vector: FAISS has no order for a NaN inner product.

    The rule of every other ranking path (a NaN score after every other one, see
    :mod:`dattri_llm.attribution.ranking`) cannot be kept inside an approximate index, so an
    index holds and answers only finite vectors (in float32, the index's dtype).

    Args:
        vectors: ``(n, D)`` float32.
        hashes: The ``n`` samples' hashes.
        side: ``"train"`` or ``"query"``, as the message names it.

    Raises:
        ValueError: naming the first such sample and how many there are.
    """
    bad = ~np.isfinite(vectors).all(axis=1)
    if not bad.any():
        return
    first = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"the {side} vector of sample {hashes[first]!r} is not finite in float32 "
        f"({int(bad.sum())} of {len(hashes)} in this block): an index cannot rank it. Its "
        "gradient holds inf / NaN, or its (summed, preconditioned) vector overflows float32; "
        "recapture that gradient (with storage_dtype='bfloat16' or 'float32' if a float16 "
        "store overflowed), or score without the index (attribute_from_cache(..., top_k=k)), "
        "which ranks NaN scores after every other."
    )


def _prepare(rows: torch.Tensor, metric: str) -> torch.Tensor:
    """The rows in float64, divided by their norms for ``"cosine"``."""
    rows = rows.to(torch.float64)
    if metric == "cosine":
        norms = rows.norm(dim=1, keepdim=True)
        rows = rows / norms.clamp_min(torch.finfo(torch.float64).tiny)
    return rows


def unit_rows(store: Any, checkpoints: set[int] | None) -> list[tuple[int, str, Any]]:
    """``(record index, partition key, RecordInfo)`` of the records to index, in store order."""
    import os

    root = os.fspath(store.save_dir)
    out = []
    for i, rec in enumerate(store.records()):
        if checkpoints is not None and rec.checkpoint not in checkpoints:
            continue
        part = os.path.relpath(rec.path.parent.parent, root)
        out.append((i, part, rec))
    return out


def plan_parts(
    rows: list[tuple[int, str, Any]],
) -> tuple[dict[str, str], dict[str, int], dict[str, int]]:
    """Each sample's partition, its number of rows, and the samples per partition.

    From the records' index alone: a sample belongs to the partition of its first row (store
    order); the partitions are listed in store order.
    """
    owner: dict[str, str] = {}
    left: dict[str, int] = {}
    for _, part, rec in rows:
        for h in rec.hashes:
            owner.setdefault(h, part)
            left[h] = left.get(h, 0) + 1
    counts = dict.fromkeys((p for _, p, _ in rows), 0)
    for part in owner.values():
        counts[part] += 1
    return owner, left, counts


class PartVectors:
    """The aggregated vectors of the samples one part holds, in id order."""

    def __init__(self) -> None:
        self.hashes: list[str] = []
        self.steps: list[int] = []
        self.checkpoints: list[int] = []
        self.blocks: list[np.ndarray] = []

    def add(self, vectors: torch.Tensor, hashes: list[str], steps: list[int], ckpts: list[int]):
        """Append finished samples (``(b, D)`` float64 vectors).

        Raises:
            ValueError: a vector is not finite in float32 (:func:`check_finite_vectors`).
        """
        block = vectors.to(torch.float32).numpy()
        check_finite_vectors(block, hashes, "train")
        self.blocks.append(block)
        self.hashes += hashes
        self.steps += steps
        self.checkpoints += ckpts

    def matrix(self, dim: int) -> np.ndarray:
        """``(n, D)`` float32, C-contiguous (the blocks are freed)."""
        out = np.concatenate(self.blocks) if self.blocks else np.zeros((0, dim), np.float32)
        self.blocks = []
        return np.ascontiguousarray(out, dtype=np.float32)


def train_parts(
    store: Any,
    layers: Sequence[str],
    metric: str,
    checkpoints: set[int] | None,
    weight: Any,
    dtype: torch.dtype | None = None,
    *,
    rows: list[tuple[int, str, Any]] | None = None,
    plan: tuple[dict[str, str], dict[str, int], dict[str, int]] | None = None,
    parts: Mapping[str, PartVectors] | None = None,
    block_rows: int | None = None,
    repeats: str = "sum",
) -> Iterator[tuple[str, int, int, Any]]:
    """Stream the records; yield progress ``(part, rows done, rows total, None)``.

    The final item is ``("", total, total, parts)`` with ``parts = {partition: PartVectors}``:
    each sample belongs to the partition of its first row (store order) and its vector sums
    all its rows, wherever they are, so parts hold disjoint samples and the exact top-k of the
    store is the top-k of the parts' top-k.

    Args:
        store: The ``GradientStorageManager``.
        layers: The layers, in vector order.
        metric: ``"dot"`` or ``"cosine"``.
        checkpoints: Only records with these checkpoint labels (``None``: all).
        weight: ``weight(checkpoint) -> float`` (TracIn's checkpoint weights).
        dtype: Cast on reading (``None``: as stored).
        rows: :func:`unit_rows` of ``store`` and ``checkpoints`` (computed if ``None``).
        plan: :func:`plan_parts` of ``rows`` (computed if ``None``; its row counts are
            consumed).
        parts: Where each partition's finished samples go (``add`` is called with them in id
            order; samples of partitions not in it are skipped); default: a
            :class:`PartVectors` per partition, kept in memory. A sample
            with several rows is held (one float64 vector) until its last row is read.
        block_rows: Rows per block read from the store (default :data:`BLOCK_ROWS`).
        repeats: How a sample's rows under one checkpoint label combine, as the attributors'
            ``repeats=``: ``"sum"``, or ``"mean"`` (each row divided by the sample's number
            of rows under its label; the labels are still summed).
    """
    if rows is None:
        rows = unit_rows(store, checkpoints)
    per_label: dict[tuple[str, int], int] = {}  # (sample, label) -> its rows, for "mean"
    if repeats == "mean":
        for _, _, rec in rows:
            for h in rec.hashes:
                key = (h, int(rec.checkpoint))
                per_label[key] = per_label.get(key, 0) + 1
    owner, left, counts = plan or plan_parts(rows)  # left: consumed
    if parts is None:
        parts = {part: PartVectors() for part in counts}
    pending: dict[str, list[Any]] = {}  # hash -> [sum, step, ckpt, (step, ckpt) seen]
    total = sum(len(rec.hashes) for _, _, rec in rows)
    done = 0
    warned = False
    blocks = _record_vectors(store, rows, layers, metric, dtype, block_rows or BLOCK_ROWS)
    for _, part, rec, vec in blocks:
        w = float(weight(rec.checkpoint))
        if w != 1.0:
            vec = vec * w
        if per_label:
            c = int(rec.checkpoint)
            n = torch.tensor([per_label[(h, c)] for h in rec.hashes], dtype=vec.dtype)
            if bool((n > 1).any()):
                vec = vec / n.to(vec.device).unsqueeze(1)
        finished: dict[str, list[str]] = {}  # owner part -> hashes whose rows are all in
        direct: dict[str, list[int]] = {}  # owner part -> rows of single-row samples
        for r, h in enumerate(rec.hashes):
            if owner[h] not in parts:  # another rank's sample (a split build)
                continue
            if left[h] == 1 and h not in pending:
                direct.setdefault(owner[h], []).append(r)
                left[h] = 0
                continue
            key = (int(rec.step), int(rec.checkpoint))
            entry = pending.get(h)
            if entry is None:
                pending[h] = [vec[r].clone(), key[0], key[1], {key}]
            else:
                if key in entry[3] and not warned:
                    warned = True
                    warnings.warn(
                        f"train sample {h!r} occurs more than once at step {key[0]}: identical "
                        "samples share one id, so the index combines their rows by "
                        f"repeats={repeats!r}, as TracIn's top_k does. Deduplicate the "
                        "train set to silence this.",
                        UserWarning,
                        stacklevel=3,
                    )
                entry[0] += vec[r]
                entry[1] = entry[1] if entry[1] == key[0] else -1
                entry[2] = entry[2] if entry[2] == key[1] else -1
                entry[3].add(key)
            left[h] -= 1
            if left[h] == 0:
                finished.setdefault(owner[h], []).append(h)
        for p, rs in direct.items():
            idx = torch.as_tensor(rs, dtype=torch.long)
            parts[p].add(
                vec.index_select(0, idx),
                [rec.hashes[r] for r in rs],
                [int(rec.step)] * len(rs),
                [int(rec.checkpoint)] * len(rs),
            )
        for p, hs in finished.items():
            entries = [pending.pop(h) for h in hs]
            parts[p].add(
                torch.stack([e[0] for e in entries]),
                hs,
                [e[1] for e in entries],
                [e[2] for e in entries],
            )
        done += len(rec.hashes)
        yield part, done, total, None
    assert not pending, "every sample's rows were counted from the index"
    yield "", total, total, parts


#: Rows per block of the block reader (float64 after preparation: 64 MiB at 2048 numbers).
BLOCK_ROWS = 4096


def _record_vectors(
    store: Any,
    rows: list[tuple[int, str, Any]],
    layers: Sequence[str],
    metric: str,
    dtype: torch.dtype | None,
    block_rows: int,
) -> Iterator[tuple[int, str, Any, torch.Tensor]]:
    """``(record index, part, RecordInfo, its prepared (n, D) float64 rows)`` per record.

    A store whose layers are plain materialized tensors is read in contiguous blocks by the
    store's :class:`~dattri_llm.gradient.store.vector_reader.VectorBlockReader` (the reader of
    ``top_k`` scoring); any other (tied layers summed over their sites) one record at a time.
    """
    where = f"store {store.save_dir}"
    positions = [i for i, _, _ in rows]
    vlayers = store_vector_layers(store, positions, layers) if positions else None
    if vlayers is None:
        for index, part, rec in rows:
            g = store.load_record(index, layers=layers, dtype=dtype).gradient
            yield index, part, rec, _prepare(block_vectors(g, layers, where), metric)
        return
    by_pos = {i: (part, rec) for i, part, rec in rows}
    reader = VectorBlockReader(store, vlayers, dtype, block_rows)
    for block in reader.blocks(positions):
        vec = _prepare(torch.cat([block.layers[v.name] for v in vlayers], dim=1), metric)
        r0 = 0
        for pos in block.records:
            part, rec = by_pos[pos]
            n = len(rec.hashes)
            yield pos, part, rec, vec[r0 : r0 + n]
            r0 += n


def query_vectors(
    source: Any, layers: Sequence[str], metric: str, where: str = "test source"
) -> tuple[list[str], torch.Tensor]:
    """The test side: unique test hashes (first occurrence) and their ``(M, D)`` vectors.

    A factorized query layer (e.g. a compact ``"logra"`` capture of short queries, stored as
    per-token factors) is materialized into the vector the train side stores, as the
    attributors' inner products do.

    Every block must carry one checkpoint label (a query set captured once): the index holds
    one vector per train sample, summed over its checkpoints, which pairs with one test
    gradient per query (as a single-checkpoint test store pairs with every train checkpoint
    in ``attribute_from_cache``).

    Raises:
        ValueError: the source is empty, or holds several checkpoint labels, or gives a
            query two different gradients (two steps).
    """
    hashes: list[str] = []
    rows: list[torch.Tensor] = []
    seen: dict[str, int] = {}
    labels: set[int] = set()
    for block in source:
        if len(block.hashes) != block.gradient.batch_size:
            raise ValueError(
                f"{where}: the block at step {block.step} has {len(block.hashes)} hashes for "
                f"{block.gradient.batch_size} rows; every row needs exactly one sample hash."
            )
        labels.add(int(block.checkpoint))
        if len(labels) > 1:
            raise ValueError(
                f"{where} holds test gradients at checkpoints {sorted(labels)}: an index holds "
                "one vector per train sample (summed over its checkpoints) and pairs with one "
                "test gradient per query. Search with one checkpoint's test gradients "
                "(DiskGradientSource(test_store, checkpoints=[c])), or build one index per "
                "checkpoint (GradientIndex.build(..., checkpoints=[c]))."
            )
        vec = block_vectors(block.gradient, layers, where, materialize=True)
        keep = []
        for r, h in enumerate(block.hashes):
            if h in seen:
                if seen[h] != int(block.step):
                    raise ValueError(
                        f"test sample {h!r} has two gradients in the {where} (steps {seen[h]} "
                        f"and {block.step}); capture each query once."
                    )
                continue
            seen[h] = int(block.step)
            hashes.append(h)
            keep.append(r)
        if keep:
            rows.append(vec[torch.as_tensor(keep, dtype=torch.long)])
    if not rows:
        raise ValueError(f"the {where} yielded no gradients.")
    return hashes, _prepare(torch.cat(rows), metric)
