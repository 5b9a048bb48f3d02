"""Fact-tracing benchmark: retrieval metrics against hand-computed values, planting."""

from __future__ import annotations

import numpy as np
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


def test_bm25_row_against_hand_computed_okapi():
    """The BM25 row: Okapi BM25 (k1 = 1.5, b = 0.75, rank-bm25's idf floor), written out."""
    import math
    from types import SimpleNamespace

    pytest.importorskip("rank_bm25")
    from experiments.benchmark.tracing.run import bm25

    docs = [["a", "b"], ["a", "c", "c"], ["d"]]
    d = SimpleNamespace(doc_words=docs, query_words=[["c"], ["a", "c"]])
    scores = bm25(d)
    assert scores.shape == (3, 2)  # (documents, queries)
    k1, b, n, avgdl = 1.5, 0.75, 3, 2.0

    def tf_part(tf: int, dl: int) -> float:
        return tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))

    idf_rare = math.log((n - 1 + 0.5) / (1 + 0.5))  # b, c, d: one document each
    idf_a = math.log((n - 2 + 0.5) / (2 + 0.5))  # "a" is in 2 of 3 documents: negative
    assert idf_a < 0
    floor = 0.25 * (idf_a + 3 * idf_rare) / 4  # 0.25 x the mean idf over the 4 terms
    want = torch.tensor(
        [
            [0.0, floor * tf_part(1, 2)],
            [idf_rare * tf_part(2, 3), floor * tf_part(1, 3) + idf_rare * tf_part(2, 3)],
            [0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(scores.double(), want, rtol=1e-12, atol=1e-12)


def test_report_checks_the_target_against_each_lexical_row_paired_per_fact():
    from experiments.benchmark.tracing.metrics import mean_ci
    from experiments.benchmark.tracing.report import write_report

    def row(recall, drop):
        keys = ("recall@10", "mrr", "causal_drop", "removed_per_fact", "score_s")
        return dict(zip(keys, (recall, [1.0] * 3, drop, [10] * 3, 1.0)))

    rows = {
        "TF-IDF (scikit-learn)": row([1.0, 1.0, 1.0], [3.0, 2.0, 1.0]),
        "BM25 (rank-bm25)": row([1.0, 2 / 3, 1.0], [2.0, 2.0, 2.0]),
        "G": row([1.0, 1.0, 2 / 3], [4.0, 2.5, 1.5]),
        "R": {"refused": "the run is SGD"},
    }
    result = {
        "config": dict(seeds=[0], n_docs=9, n_facts=3, copies=3, block=4, epochs=1, k=10),
        "wall_s": 1.0,
        "omp_num_threads": "1",
        "seeds": [{"seed": 0, "recall": {"multiple_choice": 0, "top1_vocab": 0}, "rows": rows}],
    }
    text = write_report(result)
    # G is the only gradient row: G - TF-IDF paired per fact, causal drop and recall@10
    (dc, hc), (dr, hr) = mean_ci([1.0, 0.5, 0.5]), mean_ci([0.0, 0.0, -1 / 3])
    assert f"**G** minus TF-IDF (scikit-learn) = {dc:+.3f} ± {hc:.3f} nats" in text
    assert f"**G** minus TF-IDF (scikit-learn) = {dr:+.3f} ± {hr:.3f} (" in text
    assert "target check vs **TF-IDF (scikit-learn)**" in text
    assert "target check vs **BM25 (rank-bm25)**" in text
    assert "| R | refused: the run is SGD |" in text
    assert "| G | 1.000" not in text or "| 10.0 |" in text


def _tiny_cfg() -> dict:
    from experiments.benchmark.tracing.run import QUICK

    return {**QUICK, "n_docs": 40, "n_facts": 4, "epochs": 1, "batch_size": 16}


def test_causal_check_removes_exactly_k_per_fact(monkeypatch):
    """Every row's causal retraining for a fact removes exactly that row's top-k for that fact
    (no union over facts), the carriers row the fact's carriers, and the same-size control
    the carriers plus k − copies documents that carry no fact."""
    from experiments.benchmark.tracing import causal, run
    from experiments.benchmark.tracing import data as tdata

    cfg = _tiny_cfg()
    removed: list[tuple[int, ...]] = []
    real_train = run.train

    full: list = []

    def fake_train(d, keep, cfg, seed, snapshots=1, observer=None):
        if len(keep) == len(d.docs):  # the full run: train it (1 epoch, fast)
            full.append(real_train(d, keep, cfg, seed, snapshots))
            return full[-1]
        removed.append(tuple(sorted(set(range(len(d.docs))) - set(keep))))
        return full[0]  # the retraining's result does not matter here

    monkeypatch.setattr(run, "train", fake_train)
    rows = {
        k: v for k, v in run.methods(True, cfg).items() if k in ("random", "TF-IDF (scikit-learn)")
    }
    out = run.run_seed(cfg, 0, rows, lambda m: None)
    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], 0
    )
    k, n_facts = cfg["k"], cfg["n_facts"]
    want = {
        "random": tm.top_k(rows["random"](d, None, 0), k),
        "TF-IDF (scikit-learn)": tm.top_k(run.tfidf(d), k),
        **causal.control_removals(d, k, 0),
    }
    assert set(out["rows"]) == set(want)
    for name, rem in want.items():
        sizes = out["rows"][name]["removed_per_fact"]
        assert sizes == [3 if name == causal.CARRIERS else k] * n_facts, name
        assert len(out["rows"][name]["causal_drop"]) == n_facts
        for r in rem:  # each fact's removal was retrained on its own
            assert tuple(sorted(r)) in removed
    assert all(len(r) in (3, k) for r in removed)
    assert len(removed) == len(set(removed))  # identical removals share one retraining
    carrying = {i for f in d.facts for i in f.docs}
    for f, r in zip(d.facts, want[causal.FILLED]):
        assert len(r) == k and set(f.docs) <= set(r)
        assert not (set(r) - set(f.docs)) & carrying  # the padding carries no fact
    assert want[causal.CARRIERS] == [sorted(f.docs) for f in d.facts]


def test_drops_and_parallel_retraining_agree():
    from experiments.benchmark.tracing import causal

    def retrain(keep):
        x = torch.zeros(2, 3, dtype=torch.float64)
        x[0, 1], x[1, 2] = -float(len(keep)), -float(sum(keep))
        return x.numpy()

    keys = [(0, 1), (2,), (0, 1)]
    one, _ = causal.retrain_all(keys, 5, retrain, jobs=1, log=lambda m: None)
    two, _ = causal.retrain_all(keys, 5, retrain, jobs=2, log=lambda m: None)
    assert set(one) == set(two) == {(0, 1), (2,)}
    for key in one:
        assert (one[key] == two[key]).all()
    removals = {"a": [[1, 0], [2]]}  # fact 0 without {0, 1}, fact 1 without {2}
    base = torch.tensor([0.5, -1.0], dtype=torch.float64)
    got = causal.drops(removals, one, base, torch.tensor([1, 2]))["a"]
    # fact 0: keep {2, 3, 4} -> log p = -3; fact 1: keep {0, 1, 3, 4} -> log p = -8
    assert got == [0.5 + 3.0, -1.0 + 8.0]


def test_observer_leaves_the_run_bit_identical(tmp_path):
    """The trajectory rows record the run through its observer: same final weights, bit for
    bit, and one recorded update per step."""
    from dattri_llm import HookManagerConfig, hash_sample
    from experiments.benchmark.quality.methods.trajectory import Recorder
    from experiments.benchmark.tracing import data as tdata
    from experiments.benchmark.tracing import run

    cfg = {**_tiny_cfg(), "n_docs": 16, "n_facts": 2, "batch_size": 8}
    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], 0
    )
    everything = list(range(len(d.docs)))
    plain = run.train(d, everything, cfg, 0, snapshots=2)
    train, _ = run.samples(d)
    rec = Recorder(
        [hash_sample(s) for s in train],
        HookManagerConfig(capture_style="materialized"),
        tmp_path,
        keep_optimizer_at=tuple(run.snapshot_steps(len(d.docs), cfg, 2)),
    )
    watched = run.train(d, everything, cfg, 0, snapshots=2, observer=rec)
    assert rec.steps == 2 and len(rec.optimizer_states) == 2
    for a, b in zip(plain, watched):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_retrain_cache_resumes_and_names_a_corrupt_file(tmp_path):
    from experiments.benchmark.tracing import causal

    calls: list[int] = []

    def retrain(keep):
        calls.append(len(keep))
        return np.full((2, 3), -float(len(keep)))

    cache = causal.RetrainCache(tmp_path, {"seed": 0})
    first, _ = causal.retrain_all([(0,), (1, 2)], 4, retrain, log=lambda m: None, cache=cache)
    assert calls == [3, 2]
    again, secs = causal.retrain_all([(0,), (1, 2)], 4, retrain, log=lambda m: None, cache=cache)
    assert calls == [3, 2] and secs == []  # nothing retrained: both from the cache
    for key in first:
        assert (first[key] == again[key]).all()
    other = causal.RetrainCache(tmp_path, {"seed": 1})  # another context: its own keys
    assert other.get((0,)) is None
    path = next(tmp_path.glob("*.safetensors"))
    path.write_bytes(b"truncated")
    with pytest.raises(RuntimeError, match=path.name):
        for key in first:
            cache.get(key)


def _written_out_run(d, keep, cfg, seed):
    """The tracing loop written out: AdamW (no weight decay), linear decay to 0, seeded
    initialisation and batch order, the batch's mean of its documents' mean token losses."""
    import torch.nn.functional as F

    from experiments.benchmark.tracing import run

    torch.manual_seed(seed)
    model = run.TinyGPT2(vocab_size=len(d.vocab), **run.MODEL)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    bs, n = cfg["batch_size"], len(keep)
    steps, step = cfg["epochs"] * ((n + bs - 1) // bs), 0
    docs = torch.as_tensor(keep)
    for _ in range(cfg["epochs"]):
        for idx in torch.randperm(n, generator=gen).split(bs):
            for group in opt.param_groups:
                group["lr"] = cfg["lr"] * (1 - step / steps)
            x, y = d.docs[docs[idx], :-1], d.docs[docs[idx], 1:]
            per_doc = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)
            loss = per_doc.sum() / len(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    return model.state_dict()


def test_the_tracing_loop_is_the_written_out_run():
    """The tracing loop is the written-out reference run bit for bit (a last batch of 3)."""
    from experiments.benchmark.tracing import data as tdata
    from experiments.benchmark.tracing import run

    cfg = {**_tiny_cfg(), "n_docs": 16, "n_facts": 2, "batch_size": 6, "epochs": 2}
    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], 0
    )
    keep = [i for i in range(len(d.docs)) if i != 5]  # 15 documents: a last batch of 3
    plain = run.train(d, keep, cfg, 1)[-1]
    want = _written_out_run(d, keep, cfg, 1)
    for key in want:
        assert torch.equal(plain[key], want[key]), key
