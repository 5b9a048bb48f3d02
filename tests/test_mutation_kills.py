"""Tests written to kill surviving mutants of ``experiments/mutation/run_mutmut.sh``.
Each checks a core module against an independent formula written out here (torch.func
per-sample gradients, a cosine / dot product by hand), or a routing contract (a route named by
``mode`` is the route taken). CONTRIBUTING.md lists the survivors left and why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient import Factorized, layer_inner
from tests.helpers.reference import flat, per_sample_grads

V = 7
SCALE = 1e-3  # every per-sample gradient norm below 1 (a clamp at 1 would change the cosine)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.fc = nn.Linear(4, 5)
        self.head = nn.Linear(5, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(input_ids))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids)[:, :-1]
    ce = nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum")
    return SCALE * ce


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n, 5), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    model = Tiny().double()
    tr, te = ids(6, 1), ids(3, 2)
    root = tmp_path_factory.mktemp("kills")
    recs = {}
    for name, x in (("train", tr), ("test", te)):
        cap = CaptureCallback(keep_all=True)
        off = OffloadCallback(file_manager=GradientStorageManager(root / name, fsync=False))
        hm = HookManager(model, callbacks=[cap, off])
        with hm.collect(deregister_on_exit=True):
            for i in range(0, len(x), 3):
                model.zero_grad()
                loss_fn(model, {"input_ids": x[i : i + 3]}).backward()
        recs[name] = cap.records
    g_tr = per_sample_grads(model, loss_fn, {"input_ids": tr})
    g_te = per_sample_grads(model, loss_fn, {"input_ids": te})
    return model, tr, te, recs, root, g_tr, g_te


def _oracles(g_tr: dict, g_te: dict, names=None) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (lambda k: True) if names is None else (lambda k: k.split(".")[0] in names)
    a = flat({k: v for k, v in g_tr.items() if keep(k)})
    b = flat({k: v for k, v in g_te.items() if keep(k)})
    assert a.norm(dim=1).max() < 1 and b.norm(dim=1).max() < 1
    dot = a @ b.T
    cos = dot / a.norm(dim=1)[:, None] / b.norm(dim=1)[None, :]
    return dot, cos


def _args(tmp_path: Path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path), use_cpu=True, show_progress=False)


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


def test_per_call_normalized_grad_on_every_entry_point(setup, tmp_path):
    """``normalized_grad`` given to a call overrides the constructor's, on each entry point,
    and the cosine of gradients whose norms are below 1 is the cosine (float64, 1e-10)."""
    model, tr, te, recs, root, g_tr, g_te = setup
    dot, cos = _oracles(g_tr, g_te)
    task = AttributionTask(loss_func=loss_fn, model=model, loss_reduction="sum")
    train_set = [{"input_ids": r} for r in tr]
    test_set = [{"input_ids": r} for r in te]
    for default, per_call, want in ((False, True, cos), (True, False, dot)):
        att = TracInAttributor(_args(tmp_path), task=task, normalized_grad=default)
        got = att.attribute_sources(recs["train"], recs["test"], normalized_grad=per_call)
        assert _rel(got.scores, want) < 1e-10, ("sources", default)
        got = att.attribute_from_cache(root / "train", root / "test", normalized_grad=per_call)
        assert _rel(got.scores, want) < 1e-10, ("cache", default)
        got = att.attribute(train_set, test_set, normalized_grad=per_call)
        assert _rel(got.scores, want) < 1e-10, ("live", default)
        # and the constructor's value when the call gives none
        other = cos if default else dot
        assert _rel(att.attribute_sources(recs["train"], recs["test"]).scores, other) < 1e-10


def test_entry_points_pass_their_options_on(setup, tmp_path):
    """``attribute_from_cache`` / ``attribute_sources`` pass ``**kwargs`` (``top_k``) on;
    live ``attribute`` uses its ``hook_config`` (layers) and ``collate_fn``."""
    model, tr, te, recs, root, g_tr, g_te = setup
    dot, _ = _oracles(g_tr, g_te)
    att = TracInAttributor(_args(tmp_path))
    for score in (
        att.attribute_from_cache(root / "train", root / "test", top_k=2),
        att.attribute_sources(recs["train"], recs["test"], top_k=2),
    ):
        assert score.top_k_kept == 2
        top = score.top_k(2)
        for q in range(dot.shape[1]):
            want = dot[:, q].topk(2).values
            assert torch.allclose(top.proponent_scores[q], want, rtol=1e-10, atol=0)
    fc_dot, _ = _oracles(g_tr, g_te, names={"fc"})

    def collate(rows: list[torch.Tensor]) -> dict:  # raw id rows: the default collate fails
        return {"input_ids": torch.stack(rows)}

    task = AttributionTask(loss_func=loss_fn, model=model, loss_reduction="sum")
    live = TracInAttributor(_args(tmp_path), task=task).attribute(
        list(tr), list(te), hook_config=HookManagerConfig(linear_io=["fc"]), collate_fn=collate
    )
    assert _rel(live.scores, fc_dot) < 1e-10


def test_flags_and_checkpoint_weight_messages(tmp_path):
    a = _args(tmp_path)
    assert TracInAttributor(a, normalized_grad=np.bool_(True)).normalized_grad is True
    with pytest.raises(TypeError, match=r"TracInAttributor\(normalized_grad=\) must be True"):
        TracInAttributor(a, normalized_grad=1)
    with pytest.raises(TypeError, match=r"attribute_sources\(normalized_grad=\) must be True"):
        TracInAttributor(a).attribute_sources([], [], normalized_grad="yes")
    att = TracInAttributor(a, checkpoint_weights=[1.0, 2.0])  # no task: nothing to check
    assert att.checkpoint_weight(1) == 2.0
    with pytest.raises(KeyError, match=r"checkpoint 2 \(it covers 0\.\.1\)"):
        att.checkpoint_weight(2)
    with pytest.raises(KeyError, match=r"checkpoint 1 \(it covers \[0, 3\]\)"):
        TracInAttributor(a, checkpoint_weights={3: 1.0, 0: 2.0}).checkpoint_weight(1)


def test_a_named_route_is_the_route_taken(monkeypatch):
    """``mode="factorized"`` never materializes a factorized layer, ``"materialized"`` never
    forms its factorized Gram; both equal ``sum_b |sum_t g_bt a_bt^T|^2`` written out."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    gg = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    lg = Factorized(a, gg, "nn.Linear", {"in_features": 4, "out_features": 5, "bias": False})
    want = torch.einsum("bti,btj->bij", gg, a).pow(2).sum((1, 2))
    rule = type(lg.rule)

    def boom(*args, **kwargs):
        raise AssertionError("the other route was taken")

    with monkeypatch.context() as m:
        m.setattr(Factorized, "materialize", boom)
        assert _rel(layer_inner.layer_norm_sq(lg, "factorized"), want) < 1e-12
        assert _rel(layer_inner.norm_sq({"x": lg}, "factorized"), want) < 1e-12
    with monkeypatch.context() as m:
        m.setattr(rule, "norm_sq", boom)
        m.setattr(rule, "gram", boom)
        assert _rel(layer_inner.layer_norm_sq(lg, "materialized"), want) < 1e-12
        assert _rel(layer_inner.norm_sq({"x": lg}, "materialized"), want) < 1e-12
    # "auto" asks the rule's cost model
    for prefers in (True, False):
        with monkeypatch.context() as m:
            m.setattr(rule, "prefer_materialized_norm", lambda self, t, kw, p=prefers: p)
            m.setattr(rule, "norm_sq", boom) if prefers else m.setattr(
                Factorized, "materialize", boom
            )
            assert _rel(layer_inner.layer_norm_sq(lg, "auto"), want) < 1e-12


def _factorized(seed: int, b: int, t: int, d: int = 4, k: int = 3) -> Factorized:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    gg = torch.randn(b, t, k, generator=g, dtype=torch.float64)
    return Factorized(a, gg, "nn.Linear", {"in_features": d, "out_features": k, "bias": False})


def _dense(lg: Factorized) -> torch.Tensor:  # sum_t g_t a_t^T, flattened, by hand
    return torch.einsum("bti,btj->bij", lg.g, lg.a).reshape(lg.a.shape[0], -1)


def test_cross_gram_pairs_layers_by_name_defaults_and_routes(monkeypatch):
    """``cross_gram`` with its defaults, per layer, with the layers in another order, every
    named route (``"factorized"`` never materializes, ``"materialized"`` never forms the
    factorized Gram) equal the hand-made dense Gram; different layer sets are refused by name."""
    x = {"p": _factorized(1, 3, 5), "q": _factorized(2, 3, 2)}
    y = {"q": _factorized(3, 2, 4), "p": _factorized(4, 2, 6)}
    want = {n: _dense(x[n]) @ _dense(y[n]).T for n in ("p", "q")}
    total = want["p"] + want["q"]
    assert _rel(layer_inner.cross_gram(x, y), total) < 1e-12
    per = layer_inner.cross_gram(x, y, per_layer=True)
    assert set(per) == {"p", "q"} and all(_rel(per[n], want[n]) < 1e-12 for n in per)
    assert (
        _rel(layer_inner.norm_sq(x), _dense(x["p"]).pow(2).sum(1) + _dense(x["q"]).pow(2).sum(1))
        < 1e-12
    )
    rule = type(x["p"].rule)

    def boom(*args, **kwargs):
        raise AssertionError("the other route was taken")

    with monkeypatch.context() as m:
        m.setattr(Factorized, "materialize", boom)
        assert _rel(layer_inner.cross_gram(x, y, "factorized"), total) < 1e-12
    with monkeypatch.context() as m:
        m.setattr(rule, "gram", boom)
        assert _rel(layer_inner.cross_gram(x, y, "materialized"), total) < 1e-12
    with pytest.raises(
        ValueError, match=r"only in the first: \['q'\]; only in the second: \['r'\]"
    ):
        layer_inner.cross_gram(x, {"p": y["p"], "r": y["q"]})


def test_linear_called_on_one_unbatched_vector_at_batch_one():
    """A Linear applied to a 1-D vector (``fc(h[0, -1])``) in a batch of one: its ``(D,)`` input
    and ``(K,)`` output gradient are one sample's single token; exact against torch.func."""

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, 4)
            self.fc = nn.Linear(4, 3)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(input_ids)[0, -1])[None]  # (1, 3)

    def loss(model: nn.Module, batch: dict) -> torch.Tensor:
        return model(input_ids=batch["input_ids"]).sin().sum()

    torch.manual_seed(2)
    model = Last().double()
    x = ids(1, 5)
    cap = CaptureCallback()
    hm = HookManager(model, callbacks=[cap])
    with hm.collect(deregister_on_exit=True):
        loss(model, {"input_ids": x}).backward()
    ref = per_sample_grads(model, loss, {"input_ids": x})
    dense = cap.record.gradient.layers["fc"].materialize()
    got = dense.rule.unflatten(dense.data, dense.module_kwargs)
    for name in ("weight", "bias"):
        want = ref[f"fc.{name}"]
        assert got[name].shape == want.shape and _rel(got[name], want) < 1e-12, name
