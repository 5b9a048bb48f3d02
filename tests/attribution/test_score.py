"""AttributionScore: views against explicit matrices, and the safetensors + JSON round trip."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dattri_llm import AttributionScore, hash_sample


def make(tokens=False):
    g = torch.Generator().manual_seed(0)
    hashes = ["a", "b", "c", "a", "b", "d"]
    steps = [0, 0, 0, 1, 1, 1]
    scores = torch.randn(6, 3, generator=g, dtype=torch.float64)
    tok = None
    if tokens:
        tok = []
        for i in range(6):
            t = torch.randn(2 + i % 4, 3, generator=g, dtype=torch.float64)
            t[-1] = scores[i] - t[:-1].sum(0)
            tok.append(t)
    return AttributionScore(scores, hashes, steps, ["x", "y", "z"], token_scores=tok)


def test_agnostic_step_and_query():
    s = make()
    ids, m = s.agnostic_matrix()
    assert ids == ["a", "b", "c", "d"]
    sc = s.scores
    want = torch.stack([sc[0] + sc[3], sc[1] + sc[4], sc[2], sc[5]])
    assert torch.equal(m, want)
    ids1, m1 = s.step_matrix(1)
    assert ids1 == ["a", "b", "d"] and torch.equal(m1, sc[3:])
    assert set(s.step_matrices()) == {0, 1} and s.steps == [0, 1]
    q = s.query(["d", "a"], ["z", "x"])
    assert torch.equal(q, want[[3, 0]][:, [2, 0]])
    assert torch.equal(s.query(["c"]), want[[2]])
    with pytest.raises(KeyError, match="'e'"):
        s.query(["e"])
    with pytest.raises(KeyError, match="'w'"):
        s.query(["a"], ["w"])
    with pytest.raises(KeyError, match="step 5"):
        s.step_matrix(5)


def test_query_accepts_samples():
    item = {"input_ids": torch.arange(4)}
    h = hash_sample(item)
    s = AttributionScore(torch.tensor([[1.0, 2.0]]), [h], [0], ["t1", "t2"])
    assert torch.equal(s.query([item]), torch.tensor([[1.0, 2.0]]))
    assert torch.equal(s.query([item], ["t2"]), torch.tensor([[2.0]]))
    t = AttributionScore(torch.tensor([[3.0]]), [hash_sample({"0": torch.arange(4)})], [0], ["u"])
    assert torch.equal(t.query([(torch.arange(4),)]), torch.tensor([[3.0]]))  # tuple items


def test_top_k():
    s = make()
    ids, m = s.agnostic_matrix()
    top = s.top_k(2)
    assert top.test_hashes == ["x", "y", "z"]
    for j in range(3):
        order = torch.argsort(m[:, j], descending=True).tolist()
        assert top.proponent_hashes[j] == [ids[i] for i in order[:2]]
        assert top.opponent_hashes[j] == [ids[i] for i in order[::-1][:2]]
        assert torch.equal(top.proponent_scores[j], m[order[:2], j])
    assert s.top_k(10).proponent_scores.shape == (3, 4)
    with pytest.raises(ValueError, match="k must be"):
        s.top_k(0)


def brute_top(m: torch.Tensor, ids: list[str], j: int, k: int, largest: bool) -> list[str]:
    """The ``k`` ids of column ``j`` by a Python sort: finite scores first, NaN last."""
    col = m[:, j].tolist()
    finite = sorted((i for i, v in enumerate(col) if v == v), key=lambda i: col[i])
    order = (finite[::-1] if largest else finite) + [i for i, v in enumerate(col) if v != v]
    return [ids[i] for i in order[:k]]


def test_top_k_ranks_nan_scores_after_every_finite_one():
    """A NaN row (a sample whose gradient was not finite) is no proponent nor opponent."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(8, 3, generator=g, dtype=torch.float64)
    scores[2] = float("nan")  # a whole sample
    scores[5, 1] = float("nan")  # one (sample, query) score
    ids = [f"t{i}" for i in range(8)]
    s = AttributionScore(scores, ids, [0] * 8, ["x", "y", "z"])
    with pytest.warns(UserWarning, match=r"4 score\(s\) are NaN .*'t2'.*'x'"):
        top = s.top_k(3)
    for j in range(3):
        assert top.proponent_hashes[j] == brute_top(scores, ids, j, 3, True)
        assert top.opponent_hashes[j] == brute_top(scores, ids, j, 3, False)
        assert not top.proponent_scores[j].isnan().any()
        assert not top.opponent_scores[j].isnan().any()
    with pytest.warns(UserWarning, match="NaN"):
        every = s.top_k(8)  # fewer than k finite scores: the NaN ones come last
    for j in range(3):
        assert every.proponent_hashes[j] == brute_top(scores, ids, j, 8, True)
        assert every.opponent_hashes[j] == brute_top(scores, ids, j, 8, False)
    assert every.proponent_scores[:, -1].isnan().all()


def test_top_k_beyond_the_train_samples_is_every_sample():
    s = make()
    ids, m = s.agnostic_matrix()
    huge = s.top_k(10**12)  # no allocation of 10**12 columns: clamped to the 4 samples
    assert huge.proponent_scores.shape == (3, 4)
    assert huge.proponent_hashes == s.top_k(4).proponent_hashes
    kept = AttributionScore(m[:, :1].clone(), ids, [0] * 4, ["x"], top_k_kept=4, num_train=4)
    assert kept.top_k(10**12).proponent_hashes == [brute_top(m, ids, 0, 4, True)]
    few = AttributionScore(m[:3, :1].clone(), ids[:3], [0] * 3, ["x"], top_k_kept=2, num_train=4)
    with pytest.raises(ValueError, match=r"top_k\(4\) needs a run with top_k >= 4"):
        few.top_k(10**12)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="k must be a positive int"):
            s.top_k(bad)


def test_token_scores():
    s = make(tokens=True)
    pos, t = s.token_scores("a", step=1)
    assert pos.tolist() == [0, 1, 2, 3, 4] and torch.allclose(t.sum(0), s.scores[3])
    # "a" occurs with 2 positions at step 0 and 5 at step 1, scored past the shorter's 2:
    # position i is not one token in both (left padding), so no sum is formed
    with pytest.raises(
        ValueError, match=r"'a' occurs with different numbers.*\(0, 2\), \(1, 5\).*step="
    ):
        s.token_scores("a")
    with pytest.raises(KeyError):
        s.token_scores("zz")
    with pytest.raises(ValueError, match="attribution_granularity='token'"):
        make().token_scores("a")


def padded_occurrences(side: str) -> AttributionScore:
    """One sample seen twice: 3 tokens alone (step 0), in a batch padded to 5 (step 1) on
    ``side``; the padding positions score exactly zero (outside the loss)."""
    g = torch.Generator().manual_seed(1)
    own = [torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(2)]
    pad = torch.zeros(2, 2, dtype=torch.float64)
    tok = [own[0], torch.cat([own[1], pad] if side == "right" else [pad, own[1]])]
    scores = torch.stack([t.sum(0) for t in tok])
    return AttributionScore(scores, ["a", "a"], [0, 1], ["x", "y"], token_scores=tok)


def test_token_scores_line_up_occurrences_by_position_or_refuse():
    """Summed by position index, a left-padded occurrence added its tokens' scores to other
    tokens' positions; a right-padded tail (exact zeros) lines up and is summed."""
    right = padded_occurrences("right")
    pos, t = right.token_scores("a")
    assert pos.tolist() == [0, 1, 2, 3, 4]
    expected = right._token_scores[0] + right._token_scores[1][:3]  # token by token
    assert torch.equal(t[:3], expected) and not t[3:].any()
    assert torch.allclose(t.sum(0), right.query(["a"])[0], rtol=1e-12)
    left = padded_occurrences("left")
    with pytest.raises(ValueError, match="left padding.*step="):
        left.token_scores("a")
    for step in (0, 1):  # the remedy the error names: one occurrence at a time
        assert torch.equal(left.token_scores("a", step=step)[1], left._token_scores[step])


def test_save_load_round_trip(tmp_path):
    for tokens in (False, True):
        s = make(tokens)
        path = s.save(tmp_path / f"s{tokens}")
        assert sorted(os.listdir(path)) == ["scores.json", "scores.safetensors"]
        t = AttributionScore.load(path)
        assert torch.equal(t.scores, s.scores)
        assert (t.train_hashes, t.train_steps, t.test_hashes) == (
            s.train_hashes,
            s.train_steps,
            s.test_hashes,
        )
        assert t.has_token_scores == tokens
        if tokens:
            for h in "abcd":
                for step in (0, 1):
                    if (h, step) in zip(s.train_hashes, s.train_steps):
                        got = t.token_scores(h, step=step)[1]
                        assert torch.equal(got, s.token_scores(h, step=step)[1])
        with open(os.path.join(path, "scores.safetensors"), "rb") as f:
            assert not f.read(2).startswith(b"\x80")  # not a pickle


def test_save_default_dir_is_lazy_and_errors(tmp_path):
    s = make()
    with pytest.raises(ValueError, match="needs a path"):
        s.save()
    s.output_dir = str(tmp_path / "out" / "deep")
    assert not (tmp_path / "out").exists()
    assert s.save() == s.output_dir and os.path.isdir(s.output_dir)
    with pytest.raises(FileNotFoundError, match="AttributionScore.save"):
        AttributionScore.load(tmp_path / "missing")
    meta = os.path.join(s.output_dir, "scores.json")
    with open(meta) as f:
        d = json.load(f)
    d["version"] = 99
    with open(meta, "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match="version 99"):
        AttributionScore.load(s.output_dir)


def test_constructor_checks():
    with pytest.raises(ValueError, match="need 1 train hashes"):
        AttributionScore(torch.zeros(2, 1), ["a"], [0], ["x"])
    with pytest.raises(ValueError, match="unique"):
        AttributionScore(torch.zeros(1, 2), ["a"], [0], ["x", "x"])
    with pytest.raises(ValueError, match="token_scores has 0 rows"):
        AttributionScore(torch.zeros(1, 1), ["a"], [0], ["x"], token_scores=[])


# ---- repeats: a sample seen several times under one checkpoint label ---------------------------
def epochs_score(repeats="sum"):
    """Three epochs under checkpoint 0 (steps 0..2); "p" also at step 1 twice; "a" at ckpt 1."""
    g = torch.Generator().manual_seed(3)
    hashes = ["a", "p", "b", "a", "p", "p", "b", "a", "p", "b", "a"]
    steps = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 7]
    ckpts = [0] * 10 + [1]
    scores = torch.randn(len(hashes), 2, generator=g, dtype=torch.float64)
    return AttributionScore(
        scores, hashes, steps, ["x", "y"], train_checkpoints=ckpts, repeats=repeats
    )


def brute(s: AttributionScore, rule: str) -> dict[str, torch.Tensor]:
    """Per sample: sum over checkpoints of the sum / mean of its rows under that checkpoint."""
    out: dict[str, torch.Tensor] = {}
    for h in dict.fromkeys(s.train_hashes):
        total = torch.zeros(s.num_test, dtype=s.scores.dtype)
        for c in set(s.train_checkpoints):
            rows = [
                s.scores[i]
                for i in range(len(s.train_hashes))
                if s.train_hashes[i] == h and s.train_checkpoints[i] == c
            ]
            if rows:
                part = torch.stack(rows).sum(0)
                total += part / len(rows) if rule == "mean" else part
        out[h] = total
    return out


def test_occurrences_and_counts():
    s = epochs_score()
    assert s.occurrences("p") == {0: [0, 1, 1, 2]}
    assert s.occurrences("a") == {0: [0, 1, 2], 1: [7]}
    assert s.occurrence_counts() == {"a": 3, "p": 4, "b": 3}
    with pytest.raises(KeyError, match="'zz'"):
        s.occurrences("zz")


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_repeats_rule_equals_brute_force(rule):
    s = epochs_score(rule)
    ref = brute(s, rule)
    with pytest.warns(UserWarning, match="occurs 2 times at step 1"):
        ids, m = s.agnostic_matrix()
    assert ids == ["a", "p", "b"]
    for i, h in enumerate(ids):
        assert torch.allclose(m[i], ref[h], rtol=0, atol=1e-14)
    # the other rule, asked of the view, is the other formula
    other = "sum" if rule == "mean" else "mean"
    _, m2 = s.agnostic_matrix(duplicates="sum", repeats=other)
    assert torch.allclose(m2, torch.stack([brute(s, other)[h] for h in ids]), atol=1e-14)
    # step matrices are each step's share: they add up to the agnostic matrix
    total = torch.zeros_like(m)
    for _, (sids, sm) in s.step_matrices(duplicates="sum").items():
        for j, h in enumerate(sids):
            total[ids.index(h)] += sm[j]
    assert torch.allclose(total, m, atol=1e-14)
    q = s.query(["p", "b"], duplicates="sum")
    assert torch.allclose(q, torch.stack([ref["p"], ref["b"]]), atol=1e-14)
    top = s.top_k(1, duplicates="sum")
    best = max(ids, key=lambda h: float(ref[h][0]))
    assert top.proponent_hashes[0] == [best]


def test_mean_keeps_a_cosine_a_cosine():
    """Rows that are cosines of one sample over four epochs: the mean is a cosine, the sum not."""
    cos = torch.tensor([[0.9], [0.8], [0.95], [0.85], [0.9]], dtype=torch.float64)
    s = AttributionScore(cos, ["rep"] * 4 + ["best"], [0, 1, 2, 3, 0], ["q"], repeats="mean")
    ids, m = s.agnostic_matrix()
    assert m.max() <= 1.0 and torch.isclose(m[0, 0], cos[:4].mean())
    assert s.top_k(1).proponent_hashes == [["best"]]  # 0.9 over the repeated 0.875
    assert s.agnostic_matrix(repeats="sum")[1][0, 0] > 1.0  # what summing did
    assert s.top_k(1, repeats="sum").proponent_hashes == [["rep"]]


def test_repeats_warnings_and_occurrences_round_trip(tmp_path):
    s = epochs_score("mean")
    s.warnings = ["a warning of the run"]
    back = AttributionScore.load(s.save(tmp_path / "s"))
    assert back.repeats == "mean" and back.warnings == ["a warning of the run"]
    assert back.occurrences("p") == s.occurrences("p")
    assert torch.equal(back.agnostic_matrix("sum")[1], s.agnostic_matrix("sum")[1])
    # a top-k result lists the occurrences its combined rows came from, and keeps them
    kept = AttributionScore(
        torch.tensor([[1.0], [0.5]]),
        ["p", "b"],
        [-1, 3],
        ["q"],
        top_k_kept=1,
        num_train=2,
        repeats="mean",
        occurrences={"p": [(0, 0), (0, 1), (0, 1)]},
    )
    back = AttributionScore.load(kept.save(tmp_path / "k"))
    assert back.occurrences("p") == {0: [0, 1, 1]} and back.occurrences("b") == {0: [3]}
    assert back.occurrence_counts() == {"p": 3, "b": 1}
    with pytest.raises(ValueError, match="repeats='sum' needs the full scores"):
        back.agnostic_matrix(repeats="sum")
    # scores written before the option were summed: they load as "sum"
    meta = json.loads((tmp_path / "s" / "scores.json").read_text())
    for key in ("repeats", "warnings"):
        del meta[key]
    (tmp_path / "s" / "scores.json").write_text(json.dumps(meta))
    old = AttributionScore.load(tmp_path / "s")
    assert old.repeats == "sum" and old.warnings == []
    with pytest.raises(ValueError, match=r"repeats=\) must be one of"):
        AttributionScore(torch.zeros(1, 1), ["a"], [0], ["q"], repeats="max")


def test_mean_of_a_sample_seen_twice_and_every_view_takes_the_rule_it_is_given():
    """Every sample at most twice (the mean divides from two rows on), float32 scores; the rule
    passed to ``agnostic_matrix`` / ``step_matrix`` / ``step_matrices`` / ``query`` overrides
    the score's own."""
    g = torch.Generator().manual_seed(4)
    hashes, steps = ["a", "b", "a", "c"], [0, 0, 1, 1]
    scores = torch.randn(4, 2, generator=g)
    by_sum = AttributionScore(scores, hashes, steps, ["x", "y"])
    by_mean = AttributionScore(scores, hashes, steps, ["x", "y"], repeats="mean")
    want = {rule: brute(by_sum, rule) for rule in ("sum", "mean")}
    assert torch.allclose(want["mean"]["a"], (scores[0] + scores[2]) / 2)  # the brute force
    for s, own, other in ((by_sum, "sum", "mean"), (by_mean, "mean", "sum")):
        for rule, kw in ((own, {}), (other, {"repeats": other})):
            ids, m = s.agnostic_matrix(**kw)
            assert m.dtype == torch.float32 and ids == ["a", "b", "c"]
            for i, h in enumerate(ids):
                assert torch.allclose(m[i], want[rule][h], rtol=0, atol=1e-6), (own, rule, h)
            assert torch.allclose(s.query(["a"], **kw)[0], want[rule]["a"], atol=1e-6)
            # each step's share: the steps add up to the agnostic matrix under the same rule
            total = torch.zeros_like(m)
            for sids, sm in s.step_matrices(**kw).values():
                for j, h in enumerate(sids):
                    total[ids.index(h)] += sm[j]
            assert torch.allclose(total, m, atol=1e-6), (own, rule)
            sids, sm = s.step_matrix(1, **kw)
            a = sids.index("a")
            share = scores[2] / 2 if rule == "mean" else scores[2]
            assert torch.allclose(sm[a], share, atol=1e-6), (own, rule)


def test_separate_duplicates_keep_one_row_per_occurrence():
    scores = torch.tensor([[1.0, 2.0], [3.0, 5.0], [7.0, 11.0]], dtype=torch.float64)
    s = AttributionScore(scores, ["a", "a", "b"], [0, 0, 0], ["x", "y"])
    ids, m = s.agnostic_matrix(duplicates="separate")
    assert ids == ["a", "a", "b"] and torch.equal(m, scores)
    ids, m = s.step_matrix(0, duplicates="separate")
    assert ids == ["a", "a", "b"] and torch.equal(m, scores)
    ids, m = s.agnostic_matrix(duplicates="sum")
    assert ids == ["a", "b"] and torch.equal(m, torch.stack([scores[0] + scores[1], scores[2]]))


@pytest.mark.parametrize(
    "rows, steps, ckpts, tests",
    [
        (["a", "b"], [0], None, ["x"]),  # one step short
        (["a"], [0, 0], None, ["x"]),  # one hash short
        (["a", "b"], [0, 0], [0], ["x"]),  # one checkpoint short
        (["a", "b"], [0, 0], None, ["x", "y"]),  # a test hash too many
    ],
)
def test_each_label_list_must_match_the_scores(rows, steps, ckpts, tests):
    """One list of the wrong length would label the rows or columns wrongly: refused alone."""
    with pytest.raises(ValueError, match="need"):
        AttributionScore(torch.zeros(2, 1), rows, steps, tests, train_checkpoints=ckpts)
