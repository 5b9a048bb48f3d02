"""The ranking rule (NaN after every other score, both directions) and the checks of ``k``.

``rank`` is checked against a Python sort written here (the key puts NaN last), on rows with
NaN, ``±inf`` and ties, for every ``k`` up to beyond the row length.
"""

from __future__ import annotations

import math

import pytest
import torch

from dattri_llm.attribution.ranking import check_top_k, clamp_top_k, rank


def reference(row: list[float], k: int, largest: bool) -> list[float]:
    """The first ``k`` of ``row`` sorted (descending when ``largest``), NaN last."""
    finite = sorted((v for v in row if not math.isnan(v)), reverse=largest)
    return (finite + [v for v in row if math.isnan(v)])[:k]


def rows() -> torch.Tensor:
    nan, inf = float("nan"), float("inf")
    return torch.tensor(
        [
            [nan, 0.5, -1.0, nan, 2.0, -3.0],
            [nan, nan, nan, nan, nan, 1.0],
            [inf, nan, -inf, 0.0, nan, -inf],
            [1.0, 1.0, -2.0, 0.0, 3.0, 3.0],  # no NaN: the plain topk
            [nan, nan, nan, nan, nan, nan],
        ],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("k", [1, 2, 4, 6, 100])
def test_rank_puts_nan_after_every_other_score(k, largest):
    x = rows()
    vals, pos = rank(x, k, largest)
    assert vals.shape == pos.shape == (x.shape[0], min(k, x.shape[1]))
    for i, row in enumerate(x.tolist()):
        want = reference(row, k, largest)
        got = vals[i].tolist()
        assert [math.isnan(v) for v in got] == [math.isnan(v) for v in want]
        assert [v for v in got if not math.isnan(v)] == [v for v in want if not math.isnan(v)]
        # the positions name the values, each column once
        assert torch.equal(x[i, pos[i]].nan_to_num(7.0), vals[i].nan_to_num(7.0))
        assert len(set(pos[i].tolist())) == len(got)


def test_rank_keeps_the_order_of_topk_without_nan():
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    for largest in (True, False):
        v, p = rank(x, 3, largest)
        w, q = x.topk(3, dim=1, largest=largest)
        assert torch.equal(v, w) and torch.equal(p, q)


def test_check_and_clamp_top_k():
    assert check_top_k(None) is None and check_top_k(3) == 3
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="top_k must be a positive int"):
            check_top_k(bad)
    with pytest.raises(ValueError, match="^k must be a positive int"):
        check_top_k(0, "k")
    assert clamp_top_k(10**12, 8) == 8 and clamp_top_k(3, 8) == 3 and clamp_top_k(5, 0) == 1


def test_rank_ranks_the_largest_first_by_default():
    """``largest`` defaults to proponents (descending), with and without NaN."""
    for x in (rows(), torch.tensor([[0.5, -1.0, 2.0, 1.0]], dtype=torch.float64)):
        v, p = rank(x, 3)
        w, q = rank(x, 3, True)
        assert torch.equal(p, q) and torch.equal(v.nan_to_num(7.0), w.nan_to_num(7.0))
    assert rank(torch.tensor([[0.5, -1.0, 2.0]]), 1)[0].item() == 2.0
