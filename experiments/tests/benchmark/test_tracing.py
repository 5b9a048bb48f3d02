"""Fact-tracing benchmark: metrics and BM25 against hand-computed values, planting, the report's
target check and the causal check's removals."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from experiments.benchmark.tracing import causal, run
from experiments.benchmark.tracing import data as tdata
from experiments.benchmark.tracing import metrics as tm


def test_metrics_hand_computed():
    scores = torch.tensor([[0.1, 0.9], [0.5, 0.8], [0.3, 0.1], [0.9, 0.2], [0.2, 0.3]])
    relevant = [{2, 4}, {0}]  # query 0 ranks 3, 1, 2, 4, 0; query 1 ranks 0, 1, 4, 3, 2
    assert tm.rankings(scores).tolist() == [[3, 1, 2, 4, 0], [0, 1, 4, 3, 2]]
    assert [tm.recall_at_k(scores, relevant, k).tolist() for k in (2, 3, 4)] == [
        [0.0, 1.0], [0.5, 1.0], [1.0, 1.0]
    ]  # fmt: skip
    assert tm.reciprocal_rank(scores, relevant).tolist() == [pytest.approx(1 / 3), 1.0]
    assert tm.top_k(scores, 2) == [[3, 1], [0, 1]]
    assert tm.rankings(torch.zeros(4, 1)).tolist() == [[0, 1, 2, 3]]  # ties: by index
    with pytest.raises(ValueError, match="NaN"):
        tm.rankings(torch.tensor([[float("nan")], [0.0]]))
    assert tm.mean_ci([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 1.96 * (5 / 3) ** 0.5 / 2))


def test_planting_puts_each_fact_in_its_carriers_only():
    d = tdata.build(n_docs=40, n_facts=4, copies=3, block=48, vocab_words=300, seed=0)
    for q, (f, rel) in enumerate(zip(d.facts, d.relevant())):
        assert len(rel) == 3
        assert {i for i, ws in enumerate(d.doc_words) if f.attribute in ws} == rel
        assert f.entity in d.query_words[q] and f.attribute not in d.query_words[q]
    assert d.docs.shape == (40, 49)
    assert (d.query_y != -100).sum(1).tolist() == [1, 1, 1, 1]


def test_bm25_row_against_hand_computed_okapi():
    """Okapi BM25 with k1 = 1.5, b = 0.75 and rank-bm25's idf floor, written out."""
    pytest.importorskip("rank_bm25")
    d = SimpleNamespace(
        doc_words=[["a", "b"], ["a", "c", "c"], ["d"]], query_words=[["c"], ["a", "c"]]
    )
    k1, b, n, avgdl = 1.5, 0.75, 3, 2.0

    def tf(tf: int, dl: int) -> float:
        return tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))

    rare = math.log((n - 1 + 0.5) / (1 + 0.5))  # b, c, d: one document each
    floor = 0.25 * (math.log((n - 2 + 0.5) / (2 + 0.5)) + 3 * rare) / 4  # "a": a negative idf
    want = [[0.0, floor * tf(1, 2)], [rare * tf(2, 3), floor * tf(1, 3) + rare * tf(2, 3)], [0, 0]]
    torch.testing.assert_close(run.bm25(d).double(), torch.tensor(want, dtype=torch.float64))


def test_report_checks_the_target_against_each_lexical_row_paired_per_fact():
    from experiments.benchmark.tracing.report import write_report

    def row(recall, drop):
        return {"recall@10": recall, "mrr": [1.0] * 3, "causal_drop": drop,
                "removed_per_fact": [10] * 3, "score_s": 1.0}  # fmt: skip

    rows = {
        "TF-IDF (scikit-learn)": row([1.0, 1.0, 1.0], [3.0, 2.0, 1.0]),
        "BM25 (rank-bm25)": row([1.0, 2 / 3, 1.0], [2.0, 2.0, 2.0]),
        "G": row([1.0, 1.0, 2 / 3], [4.0, 2.5, 1.5]),
        "R": {"refused": "the run is SGD"},
    }
    cfg = dict(seeds=[0], n_docs=9, n_facts=3, copies=3, block=4, epochs=1, k=10)
    seed = {"seed": 0, "recall": {"multiple_choice": 0, "top1_vocab": 0}, "rows": rows}
    text = write_report({"config": cfg, "wall_s": 1.0, "omp_num_threads": "1", "seeds": [seed]})
    # G is the only gradient row: G - TF-IDF paired per fact, causal drop and recall@10
    (dc, hc), (dr, hr) = tm.mean_ci([1.0, 0.5, 0.5]), tm.mean_ci([0.0, 0.0, -1 / 3])
    assert f"**G** minus TF-IDF (scikit-learn) = {dc:+.3f} ± {hc:.3f} nats" in text
    assert f"**G** minus TF-IDF (scikit-learn) = {dr:+.3f} ± {hr:.3f} (" in text
    assert "target check vs **BM25 (rank-bm25)**" in text
    assert "| R | refused: the run is SGD |" in text


def test_causal_check_removes_exactly_k_per_fact(monkeypatch):
    """Each row's retraining for a fact removes exactly its top-k for that fact, the carriers
    row the carriers, the same-size control the carriers and k − 3 documents with no fact."""
    cfg = {**run.QUICK, "n_docs": 40, "n_facts": 4, "epochs": 1, "batch_size": 16}
    d = tdata.build(40, 4, 3, cfg["block"], cfg["vocab_words"], 0)
    removed: list[tuple[int, ...]] = []
    full = run.train(d, list(range(len(d.docs))), cfg, 0, cfg["checkpoints"])

    def fake_train(d, keep, cfg, seed, snapshots=1, observer=None):
        removed.append(tuple(sorted(set(range(len(d.docs))) - set(keep))))
        return full  # the retrainings' results do not matter here

    monkeypatch.setattr(run, "train", fake_train)
    rows = {
        k: v for k, v in run.methods(True, cfg).items() if k in ("random", "TF-IDF (scikit-learn)")
    }
    out = run.run_seed(cfg, 0, rows, lambda m: None)
    k = cfg["k"]
    want = {
        "random": tm.top_k(run.random_scores(d, None, 0), k),
        "TF-IDF (scikit-learn)": tm.top_k(run.tfidf(d), k),
        **causal.control_removals(d, k, 0),
    }
    assert set(out["rows"]) == set(want) and removed[0] == ()  # first: the full run
    for name, rem in want.items():
        assert out["rows"][name]["removed_per_fact"] == [3 if name == causal.CARRIERS else k] * 4
        assert len(out["rows"][name]["causal_drop"]) == 4
        assert all(tuple(sorted(r)) in removed for r in rem), name
    assert len(removed) == len(set(removed))  # identical removals share one retraining
    carrying = {i for f in d.facts for i in f.docs}
    for f, r in zip(d.facts, want[causal.FILLED]):
        assert len(r) == k and set(f.docs) <= set(r) and not (set(r) - set(f.docs)) & carrying
    assert want[causal.CARRIERS] == [sorted(f.docs) for f in d.facts]


def test_drops_and_parallel_retraining_agree():
    def retrain(keep):
        x = torch.zeros(2, 3, dtype=torch.float64)
        x[0, 1], x[1, 2] = -float(len(keep)), -float(sum(keep))
        return x.numpy()

    keys = [(0, 1), (2,), (0, 1)]
    one, _ = causal.retrain_all(keys, 5, retrain, jobs=1, log=lambda m: None)
    two, _ = causal.retrain_all(keys, 5, retrain, jobs=2, log=lambda m: None)
    assert set(one) == set(two) == {(0, 1), (2,)}
    assert all((one[key] == two[key]).all() for key in one)
    base = torch.tensor([0.5, -1.0], dtype=torch.float64)
    got = causal.drops({"a": [[1, 0], [2]]}, one, base, torch.tensor([1, 2]))["a"]
    # fact 0 without {0, 1}: log p = -3; fact 1 without {2}: log p = -(0 + 1 + 3 + 4)
    assert got == [0.5 + 3.0, -1.0 + 8.0]
