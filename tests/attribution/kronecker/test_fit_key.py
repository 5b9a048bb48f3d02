"""A Fisher fit is reused only for what it was fitted on (``kronecker/fit_key.py``).

Every attributor that keeps a fit (K-FAC, EK-FAC, the projected Fisher) scores, after an earlier
call on other data or settings, exactly what a fresh attributor scores: after reading other
checkpoint labels, after its store was overwritten in place, after a fit setting changed, after
in-memory blocks or live weights were modified in place. And a fit is still reused when nothing
changed (one fit serves every damping).
"""

from __future__ import annotations

import os

import pytest
import torch

from dattri_llm import (
    AttributionTask,
    DiskGradientSource,
    EKFACAttributor,
    KFACAttributor,
    ProjectedFisherAttributor,
)
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.layer_gradient import Factorized, Shared
from dattri_llm.gradient.streaming import GradientStreamer
from tests.helpers.kronecker import CONFIG, dataset, loss_fn, make_model, offload, rel, run_args

CLASSES = [KFACAttributor, EKFACAttributor, ProjectedFisherAttributor]


def two_models():
    """Two sets of weights (checkpoints 0 and 1), far apart so that their Fishers differ."""
    first, second = make_model(), make_model()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(3.0)
    return first, second


def capture(models, data, path, mode="create", first_label=0):
    """Offload ``data`` at every model of ``models`` (checkpoint labels from ``first_label``)."""
    for c, model in enumerate(models, start=first_label):
        offload(model, data, path, checkpoint=c, mode=mode if c == first_label else "append")
    return path


@pytest.fixture
def stores(tmp_path):
    models = two_models()
    train, test = dataset(8, 1), dataset(3, 2)
    capture(models, train, tmp_path / "train")
    capture(models, test, tmp_path / "test")
    return tmp_path, models, train, test


def fresh(cls, root, ctor=None, **call):
    """The scores of a fresh attributor over the stores under ``root``."""
    att = cls(run_args(root), **(ctor or {}))
    return att.attribute_from_cache(root / "train", root / "test", **call).scores


def counting(att):
    """Count the attributor's fits."""
    calls = []
    fit = att._fit
    att._fit = lambda *a, **k: calls.append(1) or fit(*a, **k)
    return calls


@pytest.mark.parametrize("cls", CLASSES)
def test_other_checkpoints_get_their_own_fit(stores, cls):
    root, *_ = stores
    tr, te = root / "train", root / "test"
    att = cls(run_args(root))
    att.attribute_from_cache(tr, te, checkpoints=[0])
    got = att.attribute_from_cache(tr, te, checkpoints=[1]).scores
    want = fresh(cls, root, checkpoints=[1])
    assert rel(got, want) < 1e-12
    # checkpoint 0's fit on checkpoint 1's gradients (what a stale fit gives) is far off
    stale = cls(run_args(root))
    stale.fit(DiskGradientSource(tr, checkpoints=[0]))
    wrong = stale.attribute_from_cache(tr, te, checkpoints=[1], factors=dict(stale.factors))
    assert rel(wrong.scores, want) > 0.5
    # and back: checkpoint 0's fit again, equal to a fresh one
    again = att.attribute_from_cache(tr, te, checkpoints=[0]).scores
    assert rel(again, fresh(cls, root, checkpoints=[0])) < 1e-12


@pytest.mark.parametrize("cls", CLASSES)
def test_a_store_overwritten_in_place_is_fitted_again(tmp_path, cls):
    first, second = two_models()
    train, test = dataset(8, 1), dataset(3, 2)
    capture([first], train, tmp_path / "train")
    capture([first], test, tmp_path / "test")
    att = cls(run_args(tmp_path, check_weights=False))  # the queries stay at the old weights
    calls = counting(att)
    before = att.attribute_from_cache(tmp_path / "train", tmp_path / "test").scores
    att.attribute_from_cache(tmp_path / "train", tmp_path / "test", damping=1e-3)
    assert len(calls) == 1  # unchanged store: one fit serves every damping
    capture([second], train, tmp_path / "train", mode="overwrite")  # same shapes, other weights
    got = att.attribute_from_cache(tmp_path / "train", tmp_path / "test").scores
    want = cls(run_args(tmp_path, check_weights=False))
    want = want.attribute_from_cache(tmp_path / "train", tmp_path / "test")
    assert len(calls) == 2
    assert rel(got, want.scores) < 1e-12
    assert rel(before, want.scores) > 0.5


@pytest.mark.parametrize("cls", CLASSES)
def test_the_layers_read_and_the_fit_settings_are_part_of_the_key(stores, cls):
    root, *_ = stores
    tr, te = root / "train", root / "test"
    att = cls(run_args(root))
    att.attribute_from_cache(tr, te, checkpoints=[1])
    if cls is ProjectedFisherAttributor:
        att.max_dim = 40  # the head's 66 numbers per sample are refused now
        with pytest.raises(ValueError, match="max_dim=40"):
            att.attribute_from_cache(tr, te, checkpoints=[1])
        att.max_dim = 8192
    else:
        att.tokens = "all"  # A averages over every position, the last (no gradient) too
        got = att.attribute_from_cache(tr, te, checkpoints=[1]).scores
        want = fresh(cls, root, {"tokens": "all"}, checkpoints=[1])
        assert rel(got, want) < 1e-12
        assert rel(fresh(cls, root, checkpoints=[1]), want) > 1e-6
        att.tokens = "gradient"
    att.attribute_from_cache(tr, te, checkpoints=[1])
    got = att.attribute_from_cache(tr, te, checkpoints=[1], layers=["fc"]).scores
    assert rel(got, fresh(cls, root, checkpoints=[1], layers=["fc"])) < 1e-12


@pytest.mark.parametrize("cls", CLASSES)
def test_in_memory_blocks_modified_in_place_are_fitted_again(tmp_path, cls):
    model = make_model()
    blocks = list(GradientStreamer(model, dataset(8, 1), loss_fn, hook_config=CONFIG, batch_size=3))
    queries = list(
        GradientStreamer(model, dataset(3, 2), loss_fn, hook_config=CONFIG, batch_size=3)
    )
    att = cls(run_args(tmp_path))
    calls = counting(att)
    att.attribute_sources(blocks, queries)
    att.attribute_sources(blocks, queries, damping=1e-3)
    assert len(calls) == 1
    for b in blocks:
        for lg in b.gradient.layers.values():
            for t in (lg.a, lg.g) if hasattr(lg, "a") else (lg.data,):
                t.mul_(2.0)  # in place: the Fisher is 4x (or its factors 2x each)
    got = att.attribute_sources(blocks, queries).scores
    assert len(calls) == 2
    want = cls(run_args(tmp_path)).attribute_sources(blocks, queries).scores
    assert rel(got, want) < 1e-12


def tied_record(step: int, n: int, seed: int) -> GradientRecord:
    """One layer whose weight is used at two sites (a :class:`Shared` of two Linear captures)."""
    gen = torch.Generator().manual_seed(seed)
    kw = {"in_features": 4, "out_features": 3, "bias": False}

    def site() -> Factorized:
        a = torch.randn(n, 2, 4, generator=gen, dtype=torch.float64)
        return Factorized(
            a, torch.randn(n, 2, 3, generator=gen, dtype=torch.float64), "nn.Linear", kw
        )

    hashes = [f"s{step}-{i}" for i in range(n)]
    return GradientRecord(step, hashes, Gradient({"tied": Shared([site(), site()], ["a", "b"])}))


@pytest.mark.parametrize("cls", CLASSES)
def test_a_shared_layers_sites_modified_in_place_are_fitted_again(tmp_path, cls):
    """A tied weight's gradient is the sum over its sites: changing the tensors of one site (not
    the first) in place changes the Fisher, so the fit must not be reused."""
    blocks = [tied_record(0, 3, seed=1), tied_record(1, 3, seed=2)]
    queries = [tied_record(0, 2, seed=3)]
    ctor = {} if cls is ProjectedFisherAttributor else {"non_kronecker": "diagonal"}
    att = cls(run_args(tmp_path), **ctor)
    calls = counting(att)
    before = att.attribute_sources(blocks, queries).scores
    att.attribute_sources(blocks, queries)
    assert len(calls) == 1
    blocks[0].gradient.layers["tied"].sites[1].a.mul_(2.0)
    got = att.attribute_sources(blocks, queries).scores
    assert len(calls) == 2
    want = cls(run_args(tmp_path), **ctor).attribute_sources(blocks, queries).scores
    assert rel(got, want) < 1e-12 and rel(before, want) > 1e-3  # the change does move the scores


@pytest.mark.parametrize("cls", CLASSES)
def test_live_weights_changed_in_place_are_fitted_again(tmp_path, cls):
    model = make_model()
    train, test = dataset(8, 1), dataset(3, 2)
    att = cls(run_args(tmp_path), task=AttributionTask(loss_fn, model))
    calls = counting(att)
    att.attribute(train, test, hook_config=CONFIG)
    att.attribute(train, test, hook_config=CONFIG, damping=1e-3)
    assert len(calls) == 1
    with torch.no_grad():
        model.fc.weight.mul_(3.0)
    got = att.attribute(train, test, hook_config=CONFIG).scores
    assert len(calls) == 2
    fresh = cls(run_args(tmp_path), task=AttributionTask(loss_fn, model))
    assert rel(got, fresh.attribute(train, test, hook_config=CONFIG).scores) < 1e-12


def test_one_test_checkpoint_against_a_fit_per_train_checkpoint_is_refused(tmp_path):
    """Its gradients would be preconditioned with one checkpoint's inverse for every train
    checkpoint; the refusal's remedy (one train checkpoint at a time) scores exactly."""
    models = two_models()
    train, test = dataset(8, 1), dataset(3, 2)
    capture(models, train, tmp_path / "train")
    capture(models[:1], test, tmp_path / "test")  # the queries at checkpoint 0 only
    att = EKFACAttributor(run_args(tmp_path))
    with pytest.raises(ValueError, match=r"checkpoint 0 only.*checkpoints=\[0\]"):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "test")
    test_store = DiskGradientSource(tmp_path / "test")
    got = att.attribute_sources(
        DiskGradientSource(tmp_path / "train", checkpoints=[0]), test_store
    ).scores
    # the same pair, the checkpoint-0 train store alone against the checkpoint-0 queries (the
    # train checkpoint at the queries' weights: another one is refused by the weights check)
    capture(models[:1], train, tmp_path / "train0")
    want = EKFACAttributor(run_args(tmp_path)).attribute_sources(
        DiskGradientSource(tmp_path / "train0"), test_store
    )
    assert rel(got, want.scores) < 1e-12


def test_a_preconditioner_is_only_that_of_a_fitted_checkpoint(stores):
    root, *_ = stores
    att = KFACAttributor(run_args(root))
    att.fit(DiskGradientSource(root / "train", checkpoints=[0]))
    with pytest.raises(ValueError, match=r"no Kronecker fit for checkpoint 1.*refit=True"):
        att.preconditioner(checkpoint=1)
    # the remedy the message gives
    att.fit(DiskGradientSource(root / "train", checkpoints=[1]), refit=True)
    pre = att.preconditioner(checkpoint=1)
    fresh = KFACAttributor(run_args(root))
    fresh.fit(DiskGradientSource(root / "train", checkpoints=[1]))
    q = next(iter(DiskGradientSource(root / "test", checkpoints=[1]))).gradient
    a, b = pre(q).layers, fresh.preconditioner(checkpoint=1)(q).layers
    for name in a:
        assert rel(a[name].materialize().data, b[name].materialize().data) < 1e-12
    assert pre.checkpoint == 1
    # a fit given without a label serves every label
    att.load_factors(att.factors[1])
    assert att.preconditioner(checkpoint=5).factors is att.factors[0]


# ---- the keys themselves: what tells two reads apart -------------------------------------------
def test_keys_tell_apart_objects_record_shares_layers_tensors_and_live_data(tmp_path):
    """Each part of a key separates two reads that a stale fit would confuse: equal-looking
    objects, another share of a store's records or layers, an in-place change of any block's
    tensor (factors and dense data), a dataset grown in place, a task's checkpoints changed."""
    from types import SimpleNamespace

    from dattri_llm.attribution.engine.units import RecordSource, Unit
    from dattri_llm.attribution.kronecker.fit_key import Same, data_key, live_key
    from dattri_llm.gradient.store import GradientStorageManager
    from tests.helpers.store import toy_record, write_store

    a, b = [1], [1]
    assert Same(a) == Same(a) and Same(a) != Same(b) and Same(a) != a

    write_store(tmp_path / "s", steps=(0, 1))
    store = GradientStorageManager(tmp_path / "s")
    assert data_key(str(tmp_path / "s")) == data_key(store) != data_key(tmp_path / "other")

    def share(indices, rows=None, layers=None):
        units = [Unit(i, ["x"], i, 0, rows) for i in indices]
        return data_key(RecordSource(store, units, layers=layers))

    assert share([0]) == share([0])
    assert len({share([0]), share([1]), share([0], rows=[0]), share([0], rows=[1])}) == 4
    assert share([0], layers=["lin"]) != share([0])

    records = [toy_record(0), toy_record(1)]
    before = data_key(records)
    assert before == data_key(records) != data_key(list(records))  # the list, by identity
    for get in (lambda g: g.layers["lin"].a, lambda g: g.layers["lin"].g):
        get(records[0].gradient).mul_(2.0)  # the first block's factors: not only the last's
        assert data_key(records) != before
        before = data_key(records)
    dense = next(lg for lg in records[0].gradient.layers.values() if hasattr(lg, "data"))
    dense.data.mul_(2.0)
    assert data_key(records) != before
    before = data_key(records)
    records[1] = toy_record(1, seed=9)  # another block in place: same list, length and labels
    assert data_key(records) != before
    # (step, gradient, hashes, label) tuples: the label is read, so relabelling is a new key
    g = records[0].gradient
    tuples = [(0, g, ["x"], 0), (1, g, ["y"], 1)]
    before = data_key(tuples)
    assert before is not None and before == data_key(tuples)
    tuples[0] = (0, g, ["x"], 1)
    assert data_key(tuples) != before
    assert data_key([(0, g, ["x"])]) is not None  # a 3-tuple: label 0

    class UserSource:  # may yield other gradients on each pass: never a key
        def __iter__(self):
            return iter(records)

    assert data_key(UserSource()) is None

    data, config = [1, 2], object()
    task = SimpleNamespace(checkpoints=[{"w": torch.ones(2)}])
    key = live_key(data, config, task)
    assert key == live_key(data, config, task)
    assert key != live_key([1, 2], config, task) and key != live_key(data, object(), task)
    assert key != live_key(data, config, SimpleNamespace(checkpoints=task.checkpoints))
    data.append(3)  # grown in place: the same object, more samples
    assert live_key(data, config, task) != key
    key = live_key(data, config, task)
    task.checkpoints[0] = {"w": torch.zeros(2)}  # another state dict at the same position
    assert live_key(data, config, task) != key
    key = live_key(data, config, task)
    task.checkpoints[0]["w"].add_(1.0)  # its tensor changed in place
    assert live_key(data, config, task) != key
    # a checkpoint file: its path, and its size and modification time (rewritten in place)
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"12")
    task = SimpleNamespace(checkpoints=[str(ckpt)])
    key = live_key(data, config, task)
    assert key == live_key(data, config, task)
    then = ckpt.stat().st_mtime_ns
    ckpt.write_bytes(b"123")
    os.utime(ckpt, ns=(then, then))  # another size, the same modification time
    assert live_key(data, config, task) != key
    key = live_key(data, config, task)
    os.utime(ckpt, ns=(0, 10**9))  # same size, another modification time
    assert live_key(data, config, task) != key
    other = tmp_path / "other.pt"
    other.write_bytes(b"123")
    os.utime(other, ns=(0, 10**9))
    key = live_key(data, config, task)
    task.checkpoints[0] = str(other)  # another file of the same size and time
    assert live_key(data, config, task) != key
    assert live_key(data, config, SimpleNamespace(checkpoints=[str(tmp_path / "gone")]))
