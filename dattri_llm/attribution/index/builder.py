"""Streaming build of a :class:`~dattri_llm.attribution.index.GradientIndex`, in bounded memory.

The store is read in blocks of ``block_rows`` rows (the store's
:class:`~dattri_llm.gradient.store.vector_reader.VectorBlockReader`); each partition's finished
sample vectors are buffered up to ``block_rows`` rows, then handed to FAISS:

- ``flat``: the index's storage is sized once (``n * D * 4`` bytes: a flat index *is* the
  vectors, FAISS must hold them) and each block is copied into it as it comes (``index.add``
  would grow it by reallocation, about 1.35x the index at the peak). Peak: the index plus one
  block.
- ``hnsw``: ``index.add`` of each block as it comes (the graph is built incrementally; FAISS
  orders a batch's insertions by level, so the graph, not the vectors, depends on the block
  size, like any approximate build).
- ``ivf``: the quantizer must be trained before anything is added, on a sample of the
  partition's vectors in id order (:func:`~dattri_llm.attribution.index.kinds.training_rows`:
  ``train_size`` rows drawn with ``seed``). The blocks are spilled, float32, to a temporary
  file in the index directory (deleted after); then one sequential pass over it gathers the
  sample, the index is trained, and a second pass adds the blocks. Peak: the index, the
  training sample (``train_size * D * 4`` bytes) and one block; disk: the vectors once more
  while building. With product quantization (``pq_m``) the spill file is kept: fsynced and
  renamed to the part's re-rank file (``part_search``), whose rows the search re-ranks
  exactly. The add pass also computes the exact top-10 of a few held-out vectors of the part,
  and the built part is then searched with them to measure its recall and, with
  ``target_recall``, choose its ``nprobe`` (:mod:`~dattri_llm.attribution.index.calibrate`).

The result is the index an in-memory build of the same vectors gives (same training sample,
same vectors in the same order): ``tests/attribution/index/test_builder.py`` checks identical top-k.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.attribution.index import kinds
from dattri_llm.attribution.index.calibrate import (
    CALIBRATION_K,
    ExactTopK,
    calibrate,
    calibration_rows,
)
from dattri_llm.attribution.index.format import part_files, rerank_file, write_json
from dattri_llm.attribution.index.part_search import open_rerank_file, uses_rerank_file
from dattri_llm.attribution.index.vectors import PartVectors

__all__ = ["PartBuilder", "part_params", "check_block_rows", "write_parts", "weights_of"]


def weights_of(checkpoint_weights: Any) -> tuple[Callable[[int], float], Any]:
    """``weight(c)`` and the JSON form of ``checkpoint_weights`` (TracIn's semantics)."""
    if checkpoint_weights is None:
        return (lambda c: 1.0), None
    if isinstance(checkpoint_weights, Mapping):
        table = {int(k): float(v) for k, v in checkpoint_weights.items()}
        saved: Any = {str(k): v for k, v in table.items()}
    else:
        table = dict(enumerate(float(w) for w in checkpoint_weights))
        saved = [table[i] for i in range(len(table))]

    def weight(c: int) -> float:
        if c not in table:
            raise KeyError(
                f"checkpoint_weights has no weight for checkpoint {c} (it covers "
                f"{sorted(table)}); give one weight per checkpoint label of the store."
            )
        return table[c]

    return weight, saved


def check_block_rows(block_rows: Any) -> int:
    """``block_rows`` checked: a positive int.

    Raises:
        ValueError: naming the argument and what it takes.
    """
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(
            f"block_rows must be a positive int (rows read and added per block; memory grows "
            f"with it by about rows x dimension x 12 bytes), got {block_rows!r}."
        )
    return block_rows


def part_params(kind: str, params: dict[str, Any], n: int) -> dict[str, Any]:
    """A partition's parameters: a small partition of a large store gets fewer IVF lists."""
    if kind == "ivf" and params["nlist"] > n:
        out = {**params, "nlist": max(1, n // 39)}  # as many lists as it can train
        out["nprobe"] = min(out["nprobe"], out["nlist"])
        return out
    return params


class PartBuilder(PartVectors):
    """One partition's FAISS index, filled block by block (see the module docstring).

    Args:
        kind: ``"flat"``, ``"ivf"`` or ``"hnsw"``.
        dim: Numbers per vector.
        params: The partition's parameters (:func:`part_params`).
        n: The number of samples the partition will receive.
        block_rows: Rows buffered before a block goes to FAISS (or to the spill file).
        spill: The temporary file of an ``ivf`` build.
    """

    def __init__(
        self, kind: str, dim: int, params: dict[str, Any], n: int, block_rows: int, spill: Path
    ) -> None:
        super().__init__()
        self.kind, self.dim, self.params, self.n = kind, dim, params, n
        self.block_rows = block_rows
        self.index = kinds.empty_index(kind, dim, params, n)
        self._buffered = 0
        self._filled = 0
        self._flat = kinds.flat_storage(self.index, n) if kind == "flat" else None
        self.calibration: dict[str, Any] | None = None  # ivf: the measured recall
        self.calibration_seconds = 0.0  # its searches (not in index.json's parts: same bytes)
        self.spill = spill if kind == "ivf" else None
        self._file = open(spill, "wb") if self.spill is not None else None  # noqa: SIM115

    def add(self, vectors: torch.Tensor, hashes: list[str], steps: list[int], ckpts: list[int]):
        """Append finished samples (``(b, D)`` vectors); a full buffer goes to FAISS."""
        super().add(vectors, hashes, steps, ckpts)
        self._buffered += len(hashes)
        if self._buffered >= self.block_rows:
            self._flush()

    def _flush(self) -> None:
        if not self.blocks:
            return
        chunk = self.matrix(self.dim)
        self._buffered = 0
        if self._filled + len(chunk) > self.n:
            raise self._changed()
        if self._file is not None:
            chunk.tofile(self._file)
        elif self._flat is not None:  # straight into the index's storage, sized once
            self._flat[self._filled : self._filled + len(chunk)] = chunk
        else:
            self.index.add(chunk)
        self._filled += len(chunk)

    def _changed(self) -> RuntimeError:
        return RuntimeError(
            f"a partition received {len(self.hashes)} samples, its plan (the store's index, "
            f"read first) said {self.n}: the store changed while the index was built; build "
            "it again."
        )

    def _spilled(self) -> Any:
        """The spilled vectors, ``(b, D)`` float32 blocks of ``block_rows`` rows, in order."""
        assert self.spill is not None
        with open(self.spill, "rb") as f:
            while True:
                chunk = np.fromfile(f, dtype=np.float32, count=self.block_rows * self.dim)
                if not chunk.size:
                    return
                yield chunk.reshape(-1, self.dim)

    def finish(self) -> Any:
        """The filled index (``ivf``: trained first; its spill file removed or kept).

        With PQ the spill file is kept for :meth:`keep_spill` (the part's re-rank file).
        """
        self._flush()
        if len(self.hashes) != self.n:
            raise self._changed()
        if self._flat is not None:
            self.index.ntotal = self.n
            self._flat = None
        if self._file is not None:
            if self.keeps_spill:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            if self.n:
                self._train_fill_calibrate()
            if not self.keeps_spill:
                self.close()
        kinds.set_search_params(self.index, self.kind, self.params)
        return self.index

    def _train_fill_calibrate(self) -> None:
        """Train on the sample, add the spilled blocks, then measure the part's recall."""
        k = min(CALIBRATION_K, self.n - 1)
        rows = calibration_rows(self.n, self.params) if k > 0 else np.zeros(0, np.int64)
        sample, queries = self._gather(kinds.training_rows(self.n, self.params), rows)
        self.index = kinds.train_index(self.index, self.params, sample)
        del sample
        exact = ExactTopK(queries, rows, k) if len(rows) else None
        r0 = 0
        for chunk in self._spilled():
            self.index.add(chunk)
            if exact is not None:
                exact.update(chunk, r0)  # the same pass: the store is not read again
            r0 += len(chunk)
        if exact is None:
            return
        vectors = open_rerank_file(self.spill, self.n, self.dim) if self.keeps_spill else None
        started = time.perf_counter()
        nprobe, self.calibration = calibrate(self.index, self.params, vectors, exact)
        self.calibration_seconds = time.perf_counter() - started
        self.params = {**self.params, "nprobe": nprobe}  # a copy: may be the build's dict

    @property
    def keeps_spill(self) -> bool:
        """Whether the spill file becomes the part's re-rank file (``ivf`` with PQ)."""
        return self.spill is not None and uses_rerank_file(self.kind, self.params)

    def keep_spill(self, path: Path) -> None:
        """Rename the (fsynced) spill file to ``path``: the part's re-rank file."""
        assert self.spill is not None and self._file is None
        os.replace(self.spill, path)
        self.spill = None

    def _gather(self, *row_sets: np.ndarray | None) -> list[np.ndarray]:
        """The spilled rows of each sorted set (``None``: all), in one pass over the file."""
        picked: list[list[np.ndarray]] = [[] for _ in row_sets]
        r0 = 0
        for chunk in self._spilled():
            for rows, out in zip(row_sets, picked):
                if rows is None:
                    out.append(chunk)
                else:
                    lo, hi = np.searchsorted(rows, [r0, r0 + len(chunk)])
                    out.append(chunk[rows[lo:hi] - r0])
            r0 += len(chunk)
        empty = np.zeros((0, self.dim), np.float32)
        return [np.ascontiguousarray(np.concatenate([empty, *out]), np.float32) for out in picked]

    def close(self) -> None:
        """Remove the spill file (after the build, or when it failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.spill is not None and self.spill.exists():
            os.unlink(self.spill)


def write_parts(
    builders: dict[str, PartBuilder], number: dict[str, int], directory: Path
) -> tuple[list, list, list]:
    """Finish every partition and write its files.

    The FAISS file atomically, the re-rank file (``ivf`` with PQ: the spill file renamed),
    then its samples JSON (``index.json``, written by the caller after all parts, makes them
    valid).

    Returns:
        ``([(partition number, its entry of index.json's "parts")], [(index, hashes, steps,
        checkpoints)], [its memory-mapped re-rank file, or None])``.
    """
    faiss = kinds.import_faiss()
    entries, opened, rerank = [], [], []
    for rel, pb in builders.items():
        i = number[rel]
        index = pb.finish()
        faiss_path, samples_path = part_files(directory, i)
        tmp = faiss_path.with_name(f".{faiss_path.name}.tmp")
        faiss.write_index(index, os.fspath(tmp))
        os.replace(tmp, faiss_path)
        entry = {
            "partition": rel,
            "samples": len(pb.hashes),
            "faiss": faiss_path.name,
            "samples_file": samples_path.name,
            "params": pb.params,
            "bytes": faiss_path.stat().st_size,
        }
        if pb.calibration is not None:
            entry["calibration"] = pb.calibration
        vectors = None
        if pb.keeps_spill:
            path = rerank_file(directory, i)
            pb.keep_spill(path)
            entry["rerank_file"] = path.name
            vectors = open_rerank_file(path, len(pb.hashes), pb.dim)
        write_json(
            samples_path, {"hashes": pb.hashes, "steps": pb.steps, "checkpoints": pb.checkpoints}
        )
        entries.append((i, entry))
        opened.append((index, pb.hashes, pb.steps, pb.checkpoints))
        rerank.append(vectors)
        pb.index = None  # the caller holds it
    return entries, opened, rerank
