"""Sample identity: ids a user reproduces from the sample, and duplicates
that are reported instead of silently merged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    AttributionScore,
    AttributionTask,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)
from tests.helpers.reference import flat, per_sample_grads, rel_err


class XNet(nn.Module):
    """A model whose forward names its input ``x`` (not ``input_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return self.out(h if scale is None else h * scale)


def x_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["x"]) ** 2).sum()


def records_of(model: nn.Module, call) -> list:
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        (call() ** 2).sum().backward()
    return cb.records


def test_positional_tensor_id_is_hash_sample_of_the_tensor(tmp_path):
    model = XNet()
    x = torch.randn(3, 6)
    (rec,) = records_of(model, lambda: model(x))
    assert rec.hashes == [hash_sample(x[i]) for i in range(3)]
    # the same whatever the forward calls it, and whether the first argument is positional
    # or the keyword input_ids
    (wrapped,) = records_of(model, lambda: torch.nn.Sequential(model)(x))
    assert wrapped.hashes == rec.hashes
    # extra positional tensors keep their name and are not hashed by default
    (two,) = records_of(model, lambda: model(x, torch.ones(3, 1)))
    assert two.hashes == rec.hashes
    # a keyword keeps its keyword
    (kw,) = records_of(model, lambda: model(x=x))
    assert kw.hashes == [hash_sample({"x": x[i]}) for i in range(3)]


def test_store_lookup_finds_a_sample_given_as_the_tensor_the_model_got(tmp_path):
    model = XNet()
    x = torch.randn(4, 6)
    fm = GradientStorageManager(tmp_path)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=fm)])
    with hm.collect(deregister_on_exit=True):
        x_loss(model, {"x": x}).backward()
    store = GradientStorageManager(tmp_path)
    assert [loc.row for loc in store.lookup(x[2])] == [2]


def _score(scores: torch.Tensor, hashes: list[str], steps: list[int], m: int) -> AttributionScore:
    return AttributionScore(scores, hashes, steps, [f"t{j}" for j in range(m)])


def test_duplicated_train_sample_is_reported_not_silently_merged():
    s = torch.arange(8.0).reshape(4, 2)
    score = _score(s, ["a", "b", "a", "c"], [0, 0, 0, 0], 2)  # "a" twice at step 0
    assert score.duplicates() == {("a", 0, 0): 2}
    with pytest.warns(UserWarning, match=r"train sample 'a' occurs 2 times at step 0"):
        ids, m = score.agnostic_matrix()
    assert ids == ["a", "b", "c"] and torch.equal(m[0], s[0] + s[2])
    ids, m = score.agnostic_matrix(duplicates="separate")  # N in, N rows out
    assert ids == ["a", "b", "a", "c"] and torch.equal(m, s)
    with pytest.raises(ValueError, match="occurs 2 times"):
        score.agnostic_matrix(duplicates="error")
    with pytest.raises(ValueError, match="occurs 2 times"):
        score.top_k(1, duplicates="error")
    with pytest.raises(ValueError, match="ambiguous"):
        score.query(["a"], duplicates="separate")
    with pytest.raises(ValueError, match="duplicates must be one of"):
        score.agnostic_matrix(duplicates="merge")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(score.agnostic_matrix(duplicates="sum")[1][0], s[0] + s[2])
        assert score.step_matrix(0, duplicates="separate")[0] == ["a", "b", "a", "c"]


def test_a_sample_seen_at_several_steps_is_not_a_duplicate(tmp_path):
    import warnings

    s = torch.arange(6.0).reshape(3, 2)
    score = _score(s, ["a", "b", "a"], [0, 0, 1], 2)  # "a" at two steps (two epochs)
    assert score.duplicates() == {}
    # nor at the same step of two checkpoints (a cache captured at several model states)
    multi = AttributionScore(
        s, ["a", "b", "a"], [0, 0, 0], ["t0", "t1"], train_checkpoints=[0, 0, 1]
    )
    assert multi.duplicates() == {}
    back = AttributionScore.load(multi.save(tmp_path / "s"))
    assert back.train_checkpoints == [0, 0, 1] and back.duplicates() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, m = score.agnostic_matrix()
        assert ids == ["a", "b"] and torch.equal(m[0], s[0] + s[2])
        ids, m = score.agnostic_matrix(duplicates="separate")
        assert ids == ["a", "b"]  # one occurrence per step: the steps still sum


def test_live_train_set_with_a_duplicate_gives_every_occurrence_exactly(tmp_path):
    torch.manual_seed(0)
    model = XNet().double()
    base = [{"x": torch.randn(6, dtype=torch.float64)} for _ in range(3)]
    train = [base[0], base[1], base[0], base[2]]  # 4 items, one duplicated
    test = [{"x": torch.randn(6, dtype=torch.float64)} for _ in range(2)]
    att = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path)), task=AttributionTask(x_loss, model)
    )
    score = att.attribute(train, test)
    ref = flat(per_sample_grads(model, x_loss, {"x": torch.stack([d["x"] for d in train])}))
    tref = flat(per_sample_grads(model, x_loss, {"x": torch.stack([d["x"] for d in test])}))
    ids, m = score.agnostic_matrix(duplicates="separate")
    assert len(ids) == 4 and rel_err(m, ref @ tref.T) < 1e-10
    with pytest.warns(UserWarning, match="occurs 2 times"):
        ids, m = score.agnostic_matrix()
    assert len(ids) == 3


def test_duplicated_test_sample_gets_one_occurrences_score_not_double(tmp_path):
    torch.manual_seed(0)
    model = XNet().double()
    train = [{"x": torch.randn(6, dtype=torch.float64)} for _ in range(3)]
    q = {"x": torch.randn(6, dtype=torch.float64)}
    test = [q, {"x": torch.randn(6, dtype=torch.float64)}, q]
    att = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path)), task=AttributionTask(x_loss, model)
    )
    with pytest.warns(UserWarning, match="test sample .* occurs 2 times"):
        score = att.attribute(train, test)
    assert score.num_test == 2
    ref = flat(per_sample_grads(model, x_loss, {"x": torch.stack([d["x"] for d in train])}))
    tref = flat(per_sample_grads(model, x_loss, {"x": torch.stack([d["x"] for d in test[:2]])}))
    assert rel_err(score.query(train, test[:2]), ref @ tref.T) < 1e-10
