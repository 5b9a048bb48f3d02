"""DataSelectionCallback: dropping samples from param.grad equals never having them in the batch.

References are independent: a fresh model's backward over the kept rows only, and explicit
alignment scores from torch.func per-sample gradients (tests/helpers/reference.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    CaptureCallback,
    DataSelectionCallback,
    HookManager,
    HookManagerConfig,
    hash_batch,
)
from tests.helpers.reference import flat, per_sample_grads

V, D, T = 13, 8, 5


class Tiny(nn.Module):
    """Embedding + Linear + LayerNorm + Linear (optionally tied to the embedding)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=not tied)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.fc(self.emb(input_ids)))))


def make_loss(reduction: str):
    def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"])
        return nn.functional.cross_entropy(
            logits.reshape(-1, V), batch["labels"].reshape(-1), reduction="sum"
        ) / (batch["input_ids"].shape[0] if reduction == "mean" else 1)

    return loss_fn


sum_loss = make_loss("sum")
mean_loss = make_loss("mean")


def batch(n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, V, (n, T), generator=gen),
        "labels": torch.randint(0, V, (n, T), generator=gen),
    }


def model(tied: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Tiny(tied).double()


def capture(m: nn.Module, b: dict, config: HookManagerConfig):
    cb = CaptureCallback()
    hm = HookManager(m, config=config, callbacks=[cb])
    with hm.collect():
        sum_loss(m, b).backward()
    hm.remove()
    m.zero_grad(set_to_none=True)
    return cb.pop().gradient


def explicit_scores(m: nn.Module, train: dict, val: dict, cos: bool = False) -> torch.Tensor:
    gt = flat(per_sample_grads(m, sum_loss, train))
    r = flat(per_sample_grads(m, sum_loss, val)).mean(0)
    s = gt @ r
    return s / (gt.norm(dim=1) * r.norm()) if cos else s


def rows(b: dict, hashes: list[str]) -> list[int]:
    order = hash_batch({"input_ids": b["input_ids"]})
    return [order.index(h) for h in hashes]


def kept_grads(m0: nn.Module, batches: list[tuple[dict, list[int]]], loss_fn) -> dict:
    ref = copy.deepcopy(m0)
    ref.zero_grad(set_to_none=True)
    for b, keep in batches:
        loss_fn(ref, {k: v[keep] for k, v in b.items()}).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def assert_grads(m: nn.Module, expected: dict, tol: float = 1e-10) -> None:
    for n, p in m.named_parameters():
        err = (p.grad - expected[n]).abs().max() / expected[n].abs().max()
        assert err < tol, (n, float(err))


def run_step(m, b, loss_fn, sel, config=None):
    hm = HookManager(m, config=config or HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[sel])
    with hm.collect():
        loss_fn(m, b).backward()
    hm.remove()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("style", ["factorized", "materialized"])
def test_drop_fraction_exact(tied: bool, style: str) -> None:
    m = model(tied)
    m0 = copy.deepcopy(m)
    train, val = batch(8, 1), batch(4, 2)
    config = HookManagerConfig(linear_io=REGISTER_ALL, capture_style=style)
    sel = DataSelectionCallback(reference=capture(m, val, config), drop_fraction=0.4)
    run_step(m, train, sum_loss, sel, config)
    (h,) = sel.history
    assert len(h.dropped_hashes) == 3 and len(h.kept_hashes) == 5  # floor(0.4 * 8)
    kept, dropped = rows(train, h.kept_hashes), rows(train, h.dropped_hashes)
    assert sorted(kept + dropped) == list(range(8))
    assert_grads(m, kept_grads(m0, [(train, kept)], sum_loss))
    s = explicit_scores(m0, train, val)
    assert set(dropped) == set(torch.argsort(s)[:3].tolist())
    got = torch.tensor(h.kept_scores + h.dropped_scores, dtype=torch.float64)
    assert torch.allclose(got, s[kept + dropped], rtol=1e-10, atol=0)


def test_renormalize_mean_loss() -> None:
    m = model()
    m0 = copy.deepcopy(m)
    train, val = batch(7, 3), batch(3, 4)
    ref = capture(m, val, HookManagerConfig(linear_io=REGISTER_ALL))
    sel = DataSelectionCallback(reference=ref, drop_fraction=0.3, renormalize=True)
    run_step(m, train, mean_loss, sel)
    (h,) = sel.history
    # scale 7/5: its 2/5 increment is not a float32 number, so a float32 weight would show
    assert h.scale == 7 / 5 and len(h.dropped_hashes) == 2
    assert_grads(m, kept_grads(m0, [(train, rows(train, h.kept_hashes))], mean_loss))


def test_threshold_mode() -> None:
    m = model()
    m0 = copy.deepcopy(m)
    train, val = batch(7, 5), batch(3, 6)
    s = explicit_scores(m0, train, val)
    low = torch.sort(s).values
    thr = float(low[2] + low[3]) / 2  # between the 3rd and 4th lowest
    sel = DataSelectionCallback(reference=capture(m, val, HookManagerConfig()), threshold=thr)
    run_step(m, train, sum_loss, sel)
    (h,) = sel.history
    assert set(rows(train, h.dropped_hashes)) == set((s < thr).nonzero().flatten().tolist())
    assert len(h.dropped_hashes) == 3
    assert_grads(m, kept_grads(m0, [(train, rows(train, h.kept_hashes))], sum_loss))
    # a threshold above every score keeps the best sample only
    m = copy.deepcopy(m0)
    sel = DataSelectionCallback(reference=capture(m, val, HookManagerConfig()), threshold=1e30)
    run_step(m, train, sum_loss, sel)
    assert rows(train, sel.history[0].kept_hashes) == [int(s.argmax())]


@pytest.mark.parametrize("spelling", ["cosine", "cos"])  # "cos": an alias of the one spelling
def test_cos_scores(spelling: str) -> None:
    m = model(tied=True)
    m0 = copy.deepcopy(m)
    train, val = batch(8, 7), batch(5, 8)
    ref = capture(m, val, HookManagerConfig())
    sel = DataSelectionCallback(reference=ref, score=spelling, drop_fraction=0.25)
    assert sel.score == "cosine"
    run_step(m, train, sum_loss, sel)
    (h,) = sel.history
    s = explicit_scores(m0, train, val, cos=True)
    idx = rows(train, h.kept_hashes + h.dropped_hashes)
    assert torch.allclose(
        torch.tensor(h.kept_scores + h.dropped_scores, dtype=torch.float64), s[idx], rtol=1e-10
    )
    assert set(rows(train, h.dropped_hashes)) == set(torch.argsort(s)[:2].tolist())
    # cosine ordering differs from dot ordering here, so the test discriminates the two
    sd = explicit_scores(m0, train, val)
    assert torch.argsort(sd).tolist() != torch.argsort(s).tolist()


def test_gradient_accumulation() -> None:
    m = model(tied=True)
    m0 = copy.deepcopy(m)
    b1, b2, val = batch(5, 9), batch(6, 10), batch(3, 11)
    sel = DataSelectionCallback(reference=capture(m, val, HookManagerConfig()), drop_fraction=0.4)
    hm = HookManager(m, callbacks=[sel])
    with hm.collect():
        sum_loss(m, b1).backward()
        sum_loss(m, b2).backward()
    hm.remove()
    h1, h2 = sel.history
    assert (len(h1.dropped_hashes), len(h2.dropped_hashes)) == (2, 2)
    expected = kept_grads(
        m0, [(b1, rows(b1, h1.kept_hashes)), (b2, rows(b2, h2.kept_hashes))], sum_loss
    )
    assert_grads(m, expected)


def test_callable_reference_refresh_and_isolation() -> None:
    m = model()
    m0 = copy.deepcopy(m)
    val = batch(3, 12)
    calls = []

    def reference():
        calls.append(1)  # runs its own backward: must not touch the training .grad / hashes
        return capture(m, val, HookManagerConfig())

    sel = DataSelectionCallback(reference=reference, drop_fraction=0.5, refresh_interval=2)
    hm = HookManager(m, callbacks=[sel])
    batches = [batch(4, 20 + i) for i in range(3)]
    with hm.collect():
        for b in batches:
            sum_loss(m, b).backward()
    hm.remove()
    assert len(calls) == 2  # steps 0 and 2
    expected = kept_grads(
        m0, [(b, rows(b, h.kept_hashes)) for b, h in zip(batches, sel.history)], sum_loss
    )
    assert_grads(m, expected)


def test_sgd_step_as_if_never_in_batch() -> None:
    m = model()
    m0 = copy.deepcopy(m)
    train, val = batch(8, 13), batch(4, 14)
    sel = DataSelectionCallback(reference=capture(m, val, HookManagerConfig()), drop_fraction=0.5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    hm = HookManager(m, callbacks=[sel], optimizer=opt, precondition=False)
    with hm.collect():
        opt.zero_grad()
        mean_loss(m, train).backward()
        opt.step()
    hm.remove()
    keep = rows(train, sel.history[0].kept_hashes)
    ref = copy.deepcopy(m0)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt_ref.zero_grad()
    # mean loss without renormalize: the kept samples keep their 1/B share
    (sum_loss(ref, {k: v[keep] for k, v in train.items()}) / 8).backward()
    opt_ref.step()
    moved = 0.0
    for (n, p), q, p0 in zip(m.named_parameters(), ref.parameters(), m0.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), n
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-3


def test_errors() -> None:
    m = model()
    ref = capture(m, batch(2, 15), HookManagerConfig())
    for kwargs, word in [
        ({}, "exactly one"),
        ({"drop_fraction": 0.5, "threshold": 0.0}, "exactly one"),
        ({"drop_fraction": 1.0}, "drop_fraction"),
        ({"drop_fraction": -0.1}, "drop_fraction"),
        ({"threshold": float("nan")}, "threshold"),
        ({"drop_fraction": 0.5, "score": "l2"}, "score"),
        ({"drop_fraction": 0.5, "refresh_interval": 0}, "refresh_interval"),
        ({"drop_fraction": 0.5, "warmup_steps": -1}, "warmup_steps"),
    ]:
        with pytest.raises(ValueError, match=word):
            DataSelectionCallback(reference=ref, **kwargs)
    with pytest.raises(TypeError, match="reference"):
        DataSelectionCallback(reference=torch.zeros(3), drop_fraction=0.5)
    sel = DataSelectionCallback(reference=ref, drop_fraction=0.5)
    with pytest.raises(ValueError, match=r"not covered.*norm\.weight.*REGISTER_ALL"):
        HookManager(m, HookManagerConfig(linear_io=["emb", "fc", "head"]), callbacks=[sel])
    with pytest.raises(ValueError, match="param_grad"):
        HookManager(
            m,
            HookManagerConfig(linear_io=["emb", "fc", "head"], param_grad=["norm"]),
            callbacks=[sel],
        )
    pytest.importorskip("dattri_llm.gradient.ops.projection")
    from dattri_llm import ProjectionConfig

    with pytest.raises(ValueError, match="projection"):
        HookManager(
            m, HookManagerConfig(projection=ProjectionConfig("dense", proj_dim=4)), callbacks=[sel]
        )
    # frozen parameters need no hook
    m.norm.requires_grad_(False)
    HookManager(m, HookManagerConfig(linear_io=["emb", "fc", "head"]), callbacks=[sel]).remove()


def test_warmup_and_layer_subset_reference() -> None:
    m = model()
    m0 = copy.deepcopy(m)
    b1, b2, val = batch(4, 16), batch(4, 17), batch(3, 18)
    ref = capture(m, val, HookManagerConfig()).select_layers(["fc", "head"])
    sel = DataSelectionCallback(reference=ref, drop_fraction=0.5, warmup_steps=1)
    hm = HookManager(m, callbacks=[sel])
    with hm.collect():
        sum_loss(m, b1).backward()
        sum_loss(m, b2).backward()
    hm.remove()
    (h,) = sel.history  # the warm-up step selects nothing and is not logged
    assert h.step == 1
    assert_grads(m, kept_grads(m0, [(b1, list(range(4))), (b2, rows(b2, h.kept_hashes))], sum_loss))
    names = ["fc.weight", "fc.bias", "head.weight", "head.bias"]
    gt = flat(per_sample_grads(m0, sum_loss, b2, names))
    s = gt @ flat(per_sample_grads(m0, sum_loss, val, names)).mean(0)
    idx = rows(b2, h.kept_hashes + h.dropped_hashes)
    got = torch.tensor(h.kept_scores + h.dropped_scores, dtype=torch.float64)
    assert torch.allclose(got, s[idx], rtol=1e-10, atol=0)
