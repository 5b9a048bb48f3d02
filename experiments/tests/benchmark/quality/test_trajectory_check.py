"""char-GPT's partial removals and the functional copy of its run (``trajectory_check``).

``train_func(mask_index=z, mask_weight=w)`` keeps block ``z`` at weight ``w`` in a weighted
mean of the batch's block losses; without ``mask_weight`` the loop is the reference run bit for
bit. ``chargpt_functional_run`` (torch AdamW written out functionally, two parameter groups,
warm-up + cosine schedule) is the run in float64, and its forward-mode derivative in the
removal weight is finite where a second moment is still 0 (embedding rows no batch used).
Each is checked against a loop written out here with ``torch.optim.AdamW``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import jvp
from torch.utils.data import DataLoader

pytest.importorskip("sklearn")
pytest.importorskip("dattri")

from experiments.tests.helpers import tiny_chargpt  # noqa: E402


def _written_out(chargpt, setting, seed, weights, dtype=torch.float32):
    """The run with ``torch.optim.AdamW``: ``weights(step, idx)`` is ``None`` (the reference
    run's token mean) or the ``(B,)`` weights of a weighted mean of the blocks' mean losses.
    Returns the model and its test targets."""
    from experiments.benchmark.quality.common import seed_all

    hp = chargpt.HP
    seed_all(seed)
    model = setting.make_model().to(dtype)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": other}],
        lr=hp["lr"],
        betas=hp["betas"],
        weight_decay=0.0,
    )
    n = len(setting.train)
    for step, idx in enumerate(chargpt.batch_stream(torch.arange(n), n, seed, False), 1):
        for group in opt.param_groups:
            group["lr"] = chargpt.lr_at(step)
        x, y = setting.train.x[idx], setting.train.y[idx]
        logits = model(x)
        w = weights(step, idx)
        if w is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        else:
            ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
            w = w.to(dtype)
            loss = (w * ce).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logits = model(setting.test.x)
        target = F.cross_entropy(logits.transpose(1, 2), setting.test.y, reduction="none").mean(1)
    return model, target


def _down_weight(z, w):
    """Weights of block ``z`` at ``w`` in the batches that hold it, the plain mean elsewhere."""

    def weights(step, idx):
        if not bool((idx == z).any()):
            return None
        return torch.where(idx == z, torch.tensor(w), torch.tensor(1.0))

    return weights


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_chargpt_mask_weight_is_a_weighted_batch_mean_and_leaves_the_run_alone(monkeypatch):
    """Without ``mask_weight`` the loop is the reference run bit for bit (the token mean of
    ``F.cross_entropy``); with ``mask_weight=0.25`` block ``z`` weighs 0.25 in a weighted mean
    of the block losses of every batch holding it (bit for bit the written-out loop)."""
    chargpt, setting = tiny_chargpt(monkeypatch)
    loader = DataLoader(setting.train, batch_size=4)
    n = len(setting.train)
    z = int(chargpt.batch_stream(torch.arange(n), n, 3, False)[1][2])

    plain = setting.train_func(loader, seed=3)
    want, _ = _written_out(chargpt, setting, 3, lambda step, idx: None)
    assert _same(plain, want)

    partial = setting.train_func(loader, seed=3, mask_index=z, mask_weight=0.25)
    want, _ = _written_out(chargpt, setting, 3, _down_weight(z, 0.25))
    assert _same(partial, want)
    assert not _same(partial, plain)
    assert not _same(partial, setting.train_func(loader, seed=3, mask_index=z))  # w = 0: dropped

    with pytest.raises(ValueError, match="mask_weight needs mask_index"):
        setting.train_func(loader, seed=3, mask_weight=0.5)


def test_chargpt_functional_run_is_the_run_in_float64(monkeypatch):
    """``chargpt_functional_run`` in float64 (AdamW written out: decoupled weight decay on the
    matrices only, bias corrections, warm-up + cosine) equals ``torch.optim.AdamW`` over the
    same stream in float64, plain and with a block down-weighted, to 1e-10."""
    from experiments.benchmark.quality.trajectory_check import (
        chargpt_functional_run,
        weights_removing,
    )

    chargpt, setting = tiny_chargpt(monkeypatch)
    dt = torch.float64
    run = chargpt_functional_run(setting, dt, seed=3)
    n = len(setting.train)
    z = int(chargpt.batch_stream(torch.arange(n), n, 3, False)[1][2])
    for eps in (0.0, 0.75):
        got, params = run(weights_removing(z, eps, dt))
        model, want = _written_out(chargpt, setting, 3, _down_weight(z, 1 - eps), dt)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for k, v in model.named_parameters():
            torch.testing.assert_close(params[k], v.detach(), rtol=1e-10, atol=1e-12)


def test_chargpt_exact_derivative_equals_central_differences(monkeypatch):
    """The forward-mode derivative of the targets in the removal fraction through the
    functional run equals central differences (h = 1e-5, float64) to 1e-6 relative, with a
    character in the test blocks that no train block holds (its embedding row's second moment
    stays 0, where the square root's derivative is infinite: a plain ``sqrt`` gives NaN)."""
    from experiments.benchmark.quality.common import TupleDataset
    from experiments.benchmark.quality.trajectory_check import (
        chargpt_functional_run,
        weights_removing,
    )

    chargpt, _ = tiny_chargpt(monkeypatch)
    train, test, _, facts = chargpt.make_blocks()
    x = test.x.clone()
    x[:, 3] = 10  # a character the train blocks never hold: its wte row's moments stay 0
    test = TupleDataset(x, test.y)
    monkeypatch.setattr(chargpt, "make_blocks", lambda: (train, test, list("abcdefghijkl"), facts))
    setting = chargpt.make_setting("tiny-char-12")
    assert int(train.x.max()) < 9
    dt = torch.float64
    run = chargpt_functional_run(setting, dt, seed=3)
    n = len(setting.train)
    z = int(chargpt.batch_stream(torch.arange(n), n, 3, False)[1][2])

    def target(e):
        return run(weights_removing(z, e, dt))[0]

    zero = torch.zeros((), dtype=dt)
    _, tangent = jvp(target, (zero,), (torch.ones_like(zero),))
    assert torch.isfinite(tangent).all()
    h = 1e-5
    central = (target(zero + h) - target(zero - h)) / (2 * h)
    assert central.abs().max() > 1e-4  # the block matters
    torch.testing.assert_close(tangent, central, rtol=1e-6, atol=1e-6 * central.abs().max())


def test_gpt2_functional_run_is_the_fine_tuning_in_float64(monkeypatch):
    """gpt2's ``functional_run`` (now through the shared ``adamw_loop``) equals the fine-tuning
    written out with ``torch.optim.AdamW`` (no weight decay, linear decay, a permutation per
    epoch, tied wte / lm_head) in float64, with a block down-weighted, to 1e-10."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from experiments.benchmark.quality import trajectory_check as tc
    from experiments.benchmark.quality.common import TupleDataset
    from experiments.benchmark.quality.gpt2 import TinyGPT2, neg_log_odds, per_sample_ce

    model_kw = {"vocab_size": 13, "n_layer": 1, "n_head": 2, "n_embd": 8}
    hp = {"epochs": 2, "batch_size": 4, "lr": 1e-2, "betas": (0.9, 0.999)}
    monkeypatch.setattr(tc, "MODEL", model_kw)
    monkeypatch.setattr(tc, "HP", hp)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 13, (2, 16, 6), generator=gen)
    setting = SimpleNamespace(train=TupleDataset(x[:12], y[:12]), test=TupleDataset(x[12:], y[12:]))
    torch.manual_seed(1)
    pretrained = TinyGPT2(**model_kw).state_dict()
    dt, z, w = torch.float64, 5, 0.25
    got, params = tc.functional_run(setting, pretrained, dt, seed=2)(
        tc.weights_removing(z, 1 - w, dt)
    )

    model = TinyGPT2(**model_kw).to(dt)
    model.load_state_dict(pretrained, strict=False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], betas=hp["betas"], weight_decay=0)
    order = torch.Generator().manual_seed(2)
    steps, t = hp["epochs"] * 3, 0
    for _ in range(hp["epochs"]):
        perm = torch.randperm(12, generator=order)
        for s in range(0, 12, 4):
            t += 1
            idx = perm[s : s + 4]
            for group in opt.param_groups:
                group["lr"] = hp["lr"] * (1 - (t - 1) / steps)
            weight = torch.where(idx == z, w, 1.0).to(dt)
            ce = per_sample_ce(model, setting.train.x[idx], setting.train.y[idx])
            opt.zero_grad()
            ((weight * ce).sum() / weight.sum()).backward()
            opt.step()
    with torch.no_grad():
        want = neg_log_odds(per_sample_ce(model, setting.test.x, setting.test.y))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for k, v in model.named_parameters():
        torch.testing.assert_close(params[k], v.detach(), rtol=1e-10, atol=1e-12)
