"""One part's search of a ``GradientIndex``, and the part's re-rank file.

A part answers, for a batch of queries ``(M, D)``, its ``k`` largest inner products and its
``k`` smallest (the proponents, and the opponents as the largest with ``-q``):

- ``flat``: one torch matmul over FAISS's own vectors (a view, no copy) gives both directions
  exactly; faster than ``IndexFlatIP.search`` on one thread.
- ``ivf`` / ``hnsw``: FAISS's search, once per direction.
- ``ivf`` with product quantization (``pq_m``): the PQ codes rank a short list of
  ``rerank * k`` candidates per query, whose exact inner products are then computed from the
  part's **re-rank file** ``part_<i>.vectors.f32``: the indexed vectors, float32, row-major
  ``(n, D)``, in FAISS id order, read through a read-only memory map (``MADV_RANDOM``: a
  cold file is read row by row, without the kernel's read-around). Only the candidates' rows
  are read, so the page cache, not the process, holds the vectors: opening the index reads the
  small PQ file only (256 B per vector at ``D = 2048`` with ``kind="auto"``) and the process's
  own (anonymous) memory stays about that size. (Its resident set, ``VmRSS`` / ``VmHWM``,
  also counts the page-cache pages the kernel maps around each touched row when they are
  already cached: shared, clean, reclaimable.) The scores returned are exact (float32) inner
  products; only the candidate list is approximate. (Format version 1 kept the vectors inside
  the FAISS file, as an ``IndexRefineFlat``, which loads them all into memory; such indexes
  are still read and searched as before.)

The re-rank file is the build's spill file (``builder``: every vector of an ``ivf`` part is
spilled to disk before FAISS is trained), fsynced and renamed into place, so it costs the
build no extra pass.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.attribution.index import kinds
from dattri_llm.attribution.index.format import IndexFormatError
from dattri_llm.attribution.ranking import rank

__all__ = ["open_rerank_file", "search_part", "exact_rerank", "uses_rerank_file"]

Run = tuple[bool, torch.Tensor, torch.Tensor]  # (largest, values (M, kk), ids (M, kk))


def uses_rerank_file(kind: str, params: dict[str, Any]) -> bool:
    """Whether a part of this kind keeps a re-rank file (``ivf`` with ``pq_m``)."""
    return kind == "ivf" and params.get("pq_m") is not None


def open_rerank_file(path: Path, n: int, dim: int) -> np.ndarray:
    """The ``(n, dim)`` float32 re-rank file of a part, memory-mapped read-only.

    Raises:
        IndexFormatError: the file is missing or its size is not ``n * dim * 4`` bytes
            (truncated or from another build), naming it.
    """
    if not path.is_file():
        raise IndexFormatError(f"{path} is missing from the index; rebuild it.")
    want, got = n * dim * 4, path.stat().st_size
    if got != want:
        raise IndexFormatError(
            f"{path} holds {got} bytes, the part's {n} vectors of {dim} float32 numbers take "
            f"{want}: the file is truncated or from another build; rebuild the index."
        )
    if not n:
        return np.zeros((0, dim), np.float32)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        # a re-rank touches a few scattered rows: no read-around of the neighbouring pages
        # from disk on a cold file (the kernel's default for a mapped file's page fault)
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=np.float32).reshape(n, dim)  # read-only view


def exact_rerank(
    vectors: np.ndarray, q: np.ndarray, candidates: np.ndarray, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest exact inner products of each query among its candidates.

    Args:
        vectors: ``(n, D)`` float32 (a memory map): the part's vectors.
        q: ``(M, D)`` float32 queries.
        candidates: ``(M, R)`` ids into ``vectors``; ``-1`` where FAISS found fewer.
        k: How many to keep (``<= R``).

    Returns:
        ``(values, ids)``, each ``(M, k)``: float32 values in decreasing order, ``-inf`` and
        id ``-1`` where a query had fewer than ``k`` candidates.
    """
    cand = torch.from_numpy(np.ascontiguousarray(candidates, dtype=np.int64))
    valid = cand >= 0
    rows = torch.unique(cand[valid])  # sorted: the memory map is read once, in file order
    x = torch.from_numpy(np.ascontiguousarray(vectors[rows.numpy()], dtype=np.float32))
    qt = torch.from_numpy(np.ascontiguousarray(q, dtype=np.float32))
    pos = torch.searchsorted(rows, cand.clamp_min(0)).clamp_max(max(len(rows) - 1, 0))
    vals = torch.full(cand.shape, float("-inf"))
    if len(rows):
        # each query against its own candidates only (a batched GEMV over a gathered copy,
        # in chunks of about 64 MiB), not every query against every candidate
        per = max(1, (64 << 20) // max(1, cand.shape[1] * x.shape[1] * 4))
        for lo in range(0, len(cand), per):
            own = x[pos[lo : lo + per]]  # (c, R, D)
            vals[lo : lo + per] = torch.bmm(own, qt[lo : lo + per].unsqueeze(2)).squeeze(2)
    vals = vals.masked_fill(~valid, float("-inf"))
    top, j = rank(vals, k)
    ids = cand.gather(1, j)
    return top, torch.where(torch.isfinite(top), ids, torch.full_like(ids, -1))


def search_part(
    index: Any,
    kind: str,
    params: dict[str, Any],
    vectors: np.ndarray | None,
    q: np.ndarray,
    k: int,
) -> list[Run]:
    """A part's ``k`` largest and ``k`` smallest inner products with each query.

    Args:
        index: The part's FAISS index.
        kind: ``"flat"``, ``"ivf"`` or ``"hnsw"``.
        params: The part's search parameters (the build's, with the search's overrides).
        vectors: The part's re-rank file (``ivf`` with PQ, format 2), else ``None``.
        q: ``(M, D)`` float32 queries.
        k: How many per direction (``<=`` the part's size).

    Returns:
        ``[(True, values, ids), (False, values, ids)]``, ids ``-1`` (and values ``∓inf``)
        where an approximate search found fewer than ``k``.
    """
    if kind == "flat":
        full = torch.from_numpy(q) @ flat_vectors(index).T
        return [(True, *rank(full, k, True)), (False, *rank(full, k, False))]
    kinds.set_search_params(index, kind, params)
    runs: list[Run] = []
    for largest, sign in ((True, 1.0), (False, -1.0)):
        signed = np.ascontiguousarray(sign * q)
        if vectors is None:
            d, i = index.search(signed, k)
            d, i = torch.from_numpy(d), torch.from_numpy(i).to(torch.long)
        else:
            short = min(index.ntotal, max(k, int(params["rerank"]) * k))
            _, cand = index.search(signed, short)
            d, i = exact_rerank(vectors, signed, cand, k)
        missing = i < 0
        d = d.masked_fill(missing, float("-inf"))
        runs.append((largest, sign * d, i))
    return runs


def flat_vectors(index: Any) -> torch.Tensor:
    """``(n, D)`` float32: the vectors of a flat FAISS index, as a view of its storage."""
    faiss = kinds.import_faiss()
    flat = faiss.downcast_index(index)
    n, d = flat.ntotal, flat.d
    if not n:
        return torch.zeros(0, d)
    return torch.from_numpy(faiss.rev_swig_ptr(flat.get_xb(), n * d).reshape(n, d))
