"""KFACAttributor / EKFACAttributor end to end against explicit oracles (float64)."""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    EKFACAttributor,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    TracInAttributor,
)
from dattri_llm.gradient.callbacks import KroneckerCovarianceCallback
from dattri_llm.gradient.streaming import GradientStreamer
from tests.helpers.kronecker import (
    CONFIG,
    Oracle,
    T,
    dataset,
    dense_scores,
    loss_fn,
    make_model,
    offload,
    rel,
    run_args,
)
from tests.helpers.reference import assert_same_formula

CLASSES = {"kfac": KFACAttributor, "ekfac": EKFACAttributor}


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_live_matches_oracle_and_reuses_fit(tmp_path, kind):
    model = make_model()
    train, test = dataset(8, 1), dataset(3, 2)
    oracle = Oracle(model, train, test)
    att = CLASSES[kind](run_args(tmp_path), task=AttributionTask(loss_fn, model))
    calls = []
    fit = att._fit
    att._fit = lambda *a, **k: calls.append(1) or fit(*a, **k)
    for lam in (1e-3, 0.3):
        score = att.attribute(train, test, hook_config=CONFIG, damping=lam)
        assert rel(score.query(train, test), oracle.scores(kind, lam)) < 1e-8
    assert len(calls) == 1  # one damping-free fit served both dampings
    # a different train set is refitted
    other = dataset(8, 5)
    att.attribute(other, test, hook_config=CONFIG)
    assert len(calls) == 2
    assert not (tmp_path / "out").exists()


def test_token_granularity_matches_oracle(tmp_path):
    model = make_model()
    train, test = dataset(6, 1), dataset(2, 2)
    oracle = Oracle(model, train, test)
    att = EKFACAttributor(run_args(tmp_path), task=AttributionTask(loss_fn, model))
    score = att.attribute(
        train, test, hook_config=CONFIG, attribution_granularity="token", damping=1e-2
    )
    for i, d in enumerate(train):
        pos, tok = score.token_scores(d)
        assert tok.shape == (T, 2)
        assert rel(tok, oracle.token_scores("ekfac", 1e-2, i)) < 1e-8
    assert rel(score.query(train, test), oracle.scores("ekfac", 1e-2)) < 1e-8


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_from_cache_with_and_without_callback_covariances(tmp_path, kind):
    model = make_model()
    train, test = dataset(8, 1), dataset(3, 2)
    oracle = Oracle(model, train, test)
    cb = KroneckerCovarianceCallback()
    tr_dir = offload(model, train, tmp_path / "train", callbacks=[cb])
    te_dir = offload(model, test, tmp_path / "test")
    lam = 1e-2
    plain = CLASSES[kind](run_args(tmp_path)).attribute_from_cache(tr_dir, te_dir, damping=lam)
    assert rel(plain.query(train, test), oracle.scores(kind, lam)) < 1e-8
    att = CLASSES[kind](run_args(tmp_path))
    att.fit(tr_dir, covariances=cb, save_dir=tmp_path / "fit")
    via_cb = att.attribute_from_cache(tr_dir, te_dir, damping=lam)
    assert rel(via_cb.query(train, test), plain.query(train, test)) < 1e-10
    # a saved fit reloads into a fresh attributor and gives identical scores
    fresh = CLASSES[kind](run_args(tmp_path))
    again = fresh.attribute_from_cache(tr_dir, te_dir, damping=lam, factors=tmp_path / "fit")
    assert_same_formula(again.query(train, test), via_cb.query(train, test))
    # a fit of the other kind is refused
    wrong = CLASSES["ekfac" if kind == "kfac" else "kfac"](run_args(tmp_path))
    with pytest.raises(ValueError, match="fit"):
        wrong.attribute_from_cache(tr_dir, te_dir, factors=tmp_path / "fit")


def test_relative_damping_and_heavy_damping_limit(tmp_path):
    model = make_model()
    train, test = dataset(6, 1), dataset(2, 2)
    oracle = Oracle(model, train, test)
    task = AttributionTask(loss_fn, model)
    att = KFACAttributor(run_args(tmp_path), task=task)
    score = att.attribute(train, test, hook_config=CONFIG, damping=0.2, relative=True)
    ref = 0
    for name, (_, _, tr, te, _) in oracle.layers.items():
        fisher = oracle.fisher(name, "kfac")
        lam = 0.2 * float(torch.trace(fisher)) / len(fisher)
        ref = ref + dense_scores(fisher, te, tr, lam).T
    assert rel(score.query(train, test), ref) < 1e-8
    # the default is 0.1 x each layer's mean eigenvalue, written out the same way
    default = att.attribute(train, test, hook_config=CONFIG)
    ref = 0
    for name, (_, _, tr, te, _) in oracle.layers.items():
        fisher = oracle.fisher(name, "kfac")
        ref = ref + dense_scores(fisher, te, tr, 0.1 * float(torch.trace(fisher)) / len(fisher)).T
    assert rel(default.query(train, test), ref) < 1e-8
    # a number alone is absolute; None after it restores the default (not the last value)
    absolute = att.attribute(train, test, hook_config=CONFIG, damping=0.1)
    assert (att.damping, att.relative) == (None, None)  # nothing of a call survives it
    assert rel(absolute.query(train, test), default.query(train, test)) > 1e-3
    again = att.attribute(train, test, hook_config=CONFIG)
    assert rel(again.query(train, test), ref) < 1e-8
    with pytest.raises(ValueError, match="relative=False needs an absolute damping"):
        att.attribute(train, test, hook_config=CONFIG, relative=False)
    lam = 1e9
    heavy = EKFACAttributor(run_args(tmp_path), task=task).attribute(
        train, test, hook_config=CONFIG, damping=lam
    )
    dot = TracInAttributor(run_args(tmp_path), task=task).attribute(train, test, hook_config=CONFIG)
    assert rel(heavy.query(train, test) * lam, dot.query(train, test)) < 1e-6


def test_skipped_layers_warn_and_leave_scores(tmp_path):
    model = make_model()
    train, test = dataset(4, 1), dataset(2, 2)
    att = KFACAttributor(run_args(tmp_path), task=AttributionTask(loss_fn, model))
    with pytest.warns(UserWarning, match="left out"):
        full = att.attribute(train, test)  # default capture: emb and norm are skipped
    only = KFACAttributor(run_args(tmp_path), task=AttributionTask(loss_fn, model)).attribute(
        train, test, hook_config=CONFIG
    )
    assert rel(full.query(train, test), only.query(train, test)) < 1e-10
    assert set(att.factors[0].skipped) == {"emb", "norm"}


def test_fit_needs_data(tmp_path):
    with pytest.raises(ValueError, match="train_source"):
        EKFACAttributor(run_args(tmp_path)).fit(None)
    with pytest.raises(ValueError, match="damping"):
        KFACAttributor(run_args(tmp_path)).attribute_sources([], [], damping=-1.0)


def test_live_ekfac_streams_the_train_set_once_within_the_cache_budget(monkeypatch) -> None:
    """Fit (2 passes) and scoring reuse one live stream when it fits in live_cache_gb."""
    import dattri_llm.gradient.streaming as streaming
    from dattri_llm import AttributionTask, EKFACAttributor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model = model.double()
    data = [{"x": torch.randn(4, dtype=torch.float64), "y": torch.tensor(i % 3)} for i in range(12)]

    def loss(m, b):
        return torch.nn.functional.cross_entropy(m(b["x"]), b["y"], reduction="sum")

    calls = []
    real = streaming.GradientStreamer.__iter__

    def counting(self):
        calls.append(self.checkpoint if hasattr(self, "checkpoint") else 0)
        return real(self)

    monkeypatch.setattr(streaming.GradientStreamer, "__iter__", counting)
    scores = {}
    for budget in (2.0, 0.0):
        calls.clear()
        att = EKFACAttributor(
            AttributionArguments(
                show_progress=False, live_cache_gb=budget, per_device_train_batch_size=4
            ),
            task=AttributionTask(loss_func=loss, model=model),
        )
        scores[budget] = att.attribute(data, data[:3], damping=1e-2).agnostic_matrix()[1]
        # one test stream + train streams: 1 with the cache, 3 without (cov, eigen, score)
        assert len(calls) == (2 if budget else 4), (budget, calls)
    assert torch.allclose(scores[2.0], scores[0.0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_diagonal_non_kronecker_with_callback_covariances(tmp_path, kind):
    """``non_kronecker="diagonal"`` with covariances from a ``KroneckerCovarianceCallback``
    left at ``"skip"`` used to leave the embedding / norm out with a warning telling the user
    to pass ``non_kronecker='diagonal'`` (which they had): now refused, naming the callback's
    option; with the callback's ``"diagonal"`` the scores equal a fit from the gradients."""
    from dattri_llm import CaptureCallback

    model = make_model()

    def capture(ds, cbs):
        cap = CaptureCallback(keep_all=True)
        hm = HookManager(model, HookManagerConfig(), callbacks=[cap, *cbs])
        with hm.collect(deregister_on_exit=True):
            for i in range(0, len(ds), 4):
                ids = torch.stack([d["input_ids"] for d in ds[i : i + 4]])
                model.zero_grad()
                loss_fn(model, {"input_ids": ids}).backward()
        return cap.records

    skip_cb = KroneckerCovarianceCallback()
    diag_cb = KroneckerCovarianceCallback(non_kronecker="diagonal")
    train, test = capture(dataset(8, 1), [skip_cb, diag_cb]), capture(dataset(3, 2), [])
    assert "emb" in train[0].gradient.layers
    att = CLASSES[kind](run_args(tmp_path), non_kronecker="diagonal")
    with pytest.raises(
        ValueError, match=r"KroneckerCovarianceCallback\(non_kronecker='diagonal'\)"
    ):
        att.fit(train, covariances=skip_cb)
    plain = CLASSES[kind](run_args(tmp_path), non_kronecker="diagonal")
    want = plain.attribute_sources(train, test, damping=1e-2).scores
    assert not plain.factors[0].skipped
    att.fit(train, covariances=diag_cb)
    got = att.attribute_sources(train, test, damping=1e-2).scores
    assert rel(got, want) < 1e-10


def test_no_damping_survives_a_call(tmp_path):
    """A call's damping holds for that call alone, on every entry point (attribute_sources too)."""
    model = make_model()
    train, test = dataset(6, 1), dataset(2, 2)
    task = AttributionTask(loss_fn, model)
    blocks = list(GradientStreamer(model, train, loss_fn, hook_config=CONFIG, batch_size=3))
    queries = list(GradientStreamer(model, test, loss_fn, hook_config=CONFIG, batch_size=2))
    att = KFACAttributor(run_args(tmp_path), task=task)
    default = att.attribute_sources(blocks, queries).scores
    damped = att.attribute_sources(blocks, queries, damping=1e3).scores
    assert rel(damped, default) > 1e-3
    again = att.attribute_sources(blocks, queries).scores  # the default again, not 1e3
    assert rel(again, default) < 1e-12
    # the constructor's damping is every call's default
    fixed = KFACAttributor(run_args(tmp_path), task=task, damping=1e3)
    assert rel(fixed.attribute_sources(blocks, queries).scores, damped) < 1e-12
    pre = fixed.preconditioner()
    assert (pre.damping, pre.relative) == (1e3, False)


def test_the_mix_refusal_remedy_fit_with_queries_then_factors(tmp_path):
    """``mix > 0`` without the query side is refused; the message's remedy scores as the call."""
    model = make_model()
    blocks = list(GradientStreamer(model, dataset(8, 1), loss_fn, hook_config=CONFIG, batch_size=3))
    queries = list(
        GradientStreamer(model, dataset(3, 2), loss_fn, hook_config=CONFIG, batch_size=3)
    )
    att = EKFACAttributor(run_args(tmp_path), mix=0.5)
    with pytest.raises(ValueError, match=r"fit\(train_source, query_source=\.\.\.\).*factors="):
        att.fit(blocks)
    fit = att.fit(blocks, query_source=queries)
    got = EKFACAttributor(run_args(tmp_path), mix=0.5).attribute_sources(
        blocks, queries, factors=fit, damping=1e-2
    )
    want = EKFACAttributor(run_args(tmp_path), mix=0.5).attribute_sources(
        blocks, queries, damping=1e-2
    )
    assert rel(got.scores, want.scores) < 1e-12


def test_the_second_moment_refusal_remedy_refit(tmp_path):
    """A fit of uncorrected gradients given to a corrected attributor is refused; refitting
    (the message's remedy) scores as a fresh corrected attributor."""
    from dattri_llm import SecondMoment

    model = make_model()
    tr = offload(model, dataset(8, 1), tmp_path / "train")
    te = offload(model, dataset(3, 2), tmp_path / "test")
    g = torch.Generator().manual_seed(5)
    sm = SecondMoment(
        {"fc": torch.rand(30, generator=g) + 0.1, "head": torch.rand(66, generator=g)}
    )
    raw = EKFACAttributor(run_args(tmp_path))
    raw.fit(tr)
    att = EKFACAttributor(run_args(tmp_path), second_moment=sm)
    with pytest.raises(ValueError, match=r"uncorrected.*fit\(\.\.\., refit=True\)"):
        att.attribute_from_cache(tr, te, factors=raw.factors)
    att.fit(tr, refit=True)
    got = att.attribute_from_cache(tr, te, damping=1e-2).scores
    want = EKFACAttributor(run_args(tmp_path), second_moment=sm).attribute_from_cache(
        tr, te, damping=1e-2
    )
    assert rel(got, want.scores) < 1e-12
    assert rel(raw.attribute_from_cache(tr, te, damping=1e-2).scores, want.scores) > 1e-3
