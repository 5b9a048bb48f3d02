"""Fact-tracing benchmark: retrieval metrics against hand-computed values, planting."""

from __future__ import annotations

import pytest
import torch

from experiments.benchmark.tracing import metrics as tm


def test_recall_mrr_hand_computed():
    # 5 documents, 2 queries; columns are queries, larger = better
    scores = torch.tensor(
        [
            [0.1, 0.9],
            [0.5, 0.8],
            [0.3, 0.1],
            [0.9, 0.2],
            [0.2, 0.3],
        ]
    )
    relevant = [{2, 4}, {0}]
    # query 0 ranks 3, 1, 2, 4, 0: doc 2 at rank 3, doc 4 at rank 4
    # query 1 ranks 0, 1, 4, 3, 2: doc 0 at rank 1
    assert tm.rankings(scores).tolist() == [[3, 1, 2, 4, 0], [0, 1, 4, 3, 2]]
    assert tm.recall_at_k(scores, relevant, 2).tolist() == [0.0, 1.0]
    assert tm.recall_at_k(scores, relevant, 3).tolist() == [0.5, 1.0]
    assert tm.recall_at_k(scores, relevant, 4).tolist() == [1.0, 1.0]
    assert tm.reciprocal_rank(scores, relevant).tolist() == [pytest.approx(1 / 3), 1.0]
    assert tm.top_k(scores, 2) == [[3, 1], [0, 1]]


def test_ties_break_by_index_and_nan_refused():
    scores = torch.zeros(4, 1)
    assert tm.rankings(scores).tolist() == [[0, 1, 2, 3]]
    assert tm.reciprocal_rank(scores, [{2}]).tolist() == [pytest.approx(1 / 3)]
    with pytest.raises(ValueError, match="NaN"):
        tm.rankings(torch.tensor([[float("nan")], [0.0]]))


def test_mean_ci():
    m, h = tm.mean_ci([1.0, 2.0, 3.0, 4.0])
    assert m == pytest.approx(2.5)
    assert h == pytest.approx(1.96 * (5 / 3) ** 0.5 / 2)


def test_planting_puts_each_fact_in_its_carriers_only():
    from experiments.benchmark.tracing.data import build

    d = build(n_docs=40, n_facts=4, copies=3, block=48, vocab_words=300, seed=0)
    for f, rel in zip(d.facts, d.relevant()):
        assert len(rel) == 3
        having = {i for i, ws in enumerate(d.doc_words) if f.attribute in ws}
        assert having == rel
        assert f.entity in d.query_words[d.facts.index(f)]
        assert f.attribute not in d.query_words[d.facts.index(f)]
    assert d.docs.shape == (40, 49)
    labelled = (d.query_y != -100).sum(1)
    assert labelled.tolist() == [1, 1, 1, 1]
