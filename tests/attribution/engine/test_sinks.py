"""The streamed top-k (``TopKSink``, its merge, ``top_k_of``) under NaN scores and a huge ``k``.

References are Python sorts written here over the full matrix: finite scores only (a NaN
score is never kept, since it ranks after the empty slots as after every other score).
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.attribution.engine.sinks import TopKSink, merge_top_k, top_k_of
from dattri_llm.attribution.score import AttributionScore


def matrix() -> tuple[torch.Tensor, list[str]]:
    """``(10, 3)`` scores with NaN: sample 0 entirely (it comes first), one score of sample 6."""
    m = torch.randn(10, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    m[0] = float("nan")
    m[6, 2] = float("nan")
    return m, [f"t{i}" for i in range(10)]


def finite_top(m: torch.Tensor, ids: list[str], j: int, k: int, largest: bool) -> list[str]:
    col = m[:, j].tolist()
    order = sorted((i for i, v in enumerate(col) if v == v), key=lambda i: col[i])
    return [ids[i] for i in (order[::-1] if largest else order)[:k]]


def check(score: AttributionScore, m: torch.Tensor, ids: list[str], k: int) -> None:
    top = score.top_k(k)
    for j in range(m.shape[1]):
        assert top.proponent_hashes[j] == finite_top(m, ids, j, k, True)
        assert top.opponent_hashes[j] == finite_top(m, ids, j, k, False)
        assert not top.proponent_scores[j].isnan().any()
        assert not top.opponent_scores[j].isnan().any()


def stream(m: torch.Tensor, ids: list[str], k: int, lo: int = 0, hi: int = 10) -> TopKSink:
    """The rows ``lo:hi`` streamed in blocks of 3 (the NaN sample in the first block)."""
    sink = TopKSink(k, 3, dict.fromkeys(ids[lo:hi], 1))
    for a in range(lo, hi, 3):
        b = min(a + 3, hi)
        sink.add(m[a:b], ids[a:b], [0] * (b - a), [0] * (b - a))
    return sink


def test_streamed_top_k_never_lets_nan_displace_a_finite_score():
    m, ids = matrix()
    with pytest.warns(UserWarning, match=r"top_k: train sample 't0' has a NaN score"):
        sink = stream(m, ids, 3)
    score = sink.result(["x", "y", "z"], None)
    assert "t0" not in score.train_hashes  # NaN everywhere: never kept
    check(score, m, ids, 3)


def test_merged_ranks_rank_like_one_stream():
    m, ids = matrix()
    with pytest.warns(UserWarning, match="NaN"):
        halves = [stream(m, ids, 3, 0, 5), stream(m, ids, 3, 5, 10)]
    merged = merge_top_k([h.state() for h in halves], dict.fromkeys(ids, 1))
    check(merged.result(["x", "y", "z"], None), m, ids, 3)


def test_top_k_of_a_full_result_clamps_k_and_ranks_nan_last():
    m, ids = matrix()
    full = AttributionScore(m, ids, [0] * 10, ["x", "y", "z"])
    with pytest.warns(UserWarning, match="NaN"):
        reduced = top_k_of(full, 10**12)  # a (3, 10**12) list would not be allocated
    assert reduced.top_k_kept == 10 and reduced.num_train == 10
    check(reduced, m, ids, 3)
    top = reduced.top_k(10**12)  # all 10: the finite ones first, then the NaN ones
    for j in range(3):
        n = len(finite_top(m, ids, j, 10, True))
        assert top.proponent_hashes[j][:n] == finite_top(m, ids, j, 10, True)
        assert top.proponent_scores[j, n:].isnan().all()
