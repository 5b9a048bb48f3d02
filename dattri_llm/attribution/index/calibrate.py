"""The measured recall of an ``ivf`` part, and the smallest ``nprobe`` that reaches a target.

An IVF index's recall depends on the data: how many lists a query must visit to find its true
top-k is not a fixed fraction of ``nlist``. So an ``ivf`` build measures it. After the part is
trained and filled, ``calibration_queries`` of its own vectors, drawn with the build's
``seed`` and, where there are enough, from the vectors the quantizer was *not* trained on, are
searched as queries (leave-one-out: each query's own row is excluded from both answers), and
their top-``k`` (``k = 10``) is compared with the exact top-``k`` over every other vector of
the part, computed during the pass that adds the vectors to FAISS (no extra read of the
store). The recall of a query is the fraction of its returned ``k`` whose exact score reaches
the exact ``k``-th score (ties count as found); it is averaged over the queries, for the
proponents (largest inner products) and the opponents (largest with ``-q``) separately, and
the lower of the two is the part's recall.

With ``target_recall``, ``nprobe`` is swept over the powers of two below ``nlist``, then
``nlist`` itself, and the smallest that reaches the target is kept; without it the build's
``nprobe`` is only measured. The result goes into the part's entry of ``index.json``
(``"calibration"``) and the smallest part recall becomes the index's ``expected_recall``.

These queries are training vectors; real test queries come from another distribution and are
usually harder (``docs/benchmarks/index.md`` measures both).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from dattri_llm.attribution.index import kinds
from dattri_llm.attribution.index.part_search import search_part

__all__ = ["CALIBRATION_K", "calibration_rows", "ExactTopK", "calibrate"]

#: The ``k`` of the recall an ``ivf`` build measures (recall@10).
CALIBRATION_K = 10


def calibration_rows(n: int, params: dict[str, Any]) -> np.ndarray:
    """The sorted rows (of a part's ``n``, in id order) used as calibration queries.

    Drawn by ``numpy.random.default_rng([seed, 1])`` (a stream apart from the training
    sample's), from the rows outside the training sample when there are enough of them.
    """
    size = min(n, int(params["calibration_queries"]))
    trained = kinds.training_rows(n, params)
    pool = np.arange(n)
    if trained is not None and n - len(trained) >= size:
        pool = np.setdiff1d(pool, trained, assume_unique=True)
    rng = np.random.default_rng([int(params["seed"]), 1])
    return np.sort(rng.choice(pool, size, replace=False))


class ExactTopK:
    """The exact top-``k`` inner products of queries that are rows of the part, both ways.

    Fed the part's vectors block by block, in id order (:meth:`update`); a query's own row
    is left out.

    Args:
        queries: ``(Q, D)`` float32, the part's rows ``rows``.
        rows: ``(Q,)`` the queries' row ids.
        k: How many to keep per direction.
    """

    def __init__(self, queries: np.ndarray, rows: np.ndarray, k: int) -> None:
        self.q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        self.rows = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        self.k = k
        empty = torch.empty(len(self.rows), 0)
        self.best = {True: empty, False: empty}

    def update(self, chunk: np.ndarray, r0: int) -> None:
        """Merge the block of rows ``r0 .. r0 + len(chunk)``."""
        s = self.q @ torch.from_numpy(chunk).T
        own = (self.rows >= r0) & (self.rows < r0 + len(chunk))
        for largest, sign in ((True, 1.0), (False, -1.0)):
            signed = sign * s
            signed[own.nonzero().squeeze(1), self.rows[own] - r0] = float("-inf")
            both = torch.cat([self.best[largest], signed], 1)
            self.best[largest] = both.topk(min(self.k, both.shape[1]), dim=1).values

    def kth(self, largest: bool) -> torch.Tensor:
        """``(Q,)``: the exact ``k``-th largest signed inner product of every query."""
        return self.best[largest][:, -1]


def _recall(
    index: Any,
    params: dict[str, Any],
    vectors: np.ndarray | None,
    exact: ExactTopK,
) -> tuple[float, float]:
    """``(proponents, opponents)`` recall@k of the part's search with ``params``."""
    k = exact.k
    runs = search_part(index, "ivf", params, vectors, exact.q.numpy(), k + 1)
    out = []
    for largest, d, ids in runs:
        signed = d if largest else -d  # the search's values in its own direction
        signed = signed.masked_fill(ids == exact.rows.unsqueeze(1), float("-inf"))
        kept = signed.sort(dim=1, descending=True).values[:, :k]  # its own row left out
        kth = exact.kth(largest).unsqueeze(1)
        # float32 sums in another order: a returned score equal to the k-th up to round-off
        # is one of the true top-k (or tied with it)
        tol = 1e-5 * exact.best[largest][:, :1].abs().clamp_min(1e-30)
        hits = (kept >= kth - tol).sum(1).double() / k
        out.append(float(hits.mean()))
    return out[0], out[1]


def calibrate(
    index: Any,
    params: dict[str, Any],
    vectors: np.ndarray | None,
    exact: ExactTopK,
) -> tuple[int, dict[str, Any]]:
    """The part's ``nprobe`` and its calibration record (see the module docstring).

    Args:
        index: The part's trained and filled IVF index.
        params: The part's parameters (``nlist``, ``nprobe``, ``rerank``,
            ``target_recall``).
        vectors: The part's re-rank file (IVF-PQ), else ``None``.
        exact: The queries' exact top-k, fed every vector of the part.

    Returns:
        ``(nprobe, record)``: the ``nprobe`` to search with (the smallest that reaches
        ``target_recall``, else ``nlist``; without a target, the given one) and the
        ``"calibration"`` entry of ``index.json``.
    """
    nlist = int(kinds.import_faiss().downcast_index(index).nlist)
    target = params.get("target_recall")
    if target is None:
        sweep = [int(params["nprobe"])]
    else:
        sweep = [p for p in (2**j for j in range(nlist.bit_length())) if p < nlist] + [nlist]
    measured = []
    for nprobe in sweep:
        pro, opp = _recall(index, {**params, "nprobe": nprobe}, vectors, exact)
        measured.append({"nprobe": nprobe, "recall": min(pro, opp), "proponents": pro,
                         "opponents": opp})  # fmt: skip
        if target is not None and min(pro, opp) >= target:
            break
    chosen = measured[-1]
    if target is not None and chosen["recall"] < target:
        rerank = int(params["rerank"])
        warnings.warn(
            f"the ivf index reached recall@{exact.k} {chosen['recall']:.3f} on "
            f"{len(exact.rows)} held-out queries of its own vectors with every list probed "
            f"(nprobe = nlist = {nlist}), below target_recall={target}: the product-quantized "
            f"short list of rerank x k = {rerank} x {exact.k} candidates misses true "
            f"neighbours. Build without product quantization (kind='ivf', pq_m=None: every "
            "list probed is then exact) or exact (kind='flat'); a longer short list "
            f"(rerank={4 * rerank}) may also reach it.",
            stacklevel=2,
        )
    record = {
        "k": exact.k,
        "queries": len(exact.rows),
        "target_recall": target,
        "nprobe": chosen["nprobe"],
        "recall": chosen["recall"],
        "proponents": chosen["proponents"],
        "opponents": chosen["opponents"],
        "reached": None if target is None else chosen["recall"] >= target,
        "sweep": measured,
    }
    return chosen["nprobe"], record
