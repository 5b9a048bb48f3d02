"""CI-sized attribution-quality fixture: digits-LR under dattri's LDS protocol with a few
subsets (the exact influence function and EK-FAC must beat Grad-Dot, random scores sit at ~0),
the language-model settings' scores against torch.func, their loops' trajectory contract, and
the trajectory adapters against brute-force trajectory LOO."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, Subset

pytest.importorskip("sklearn")
pytest.importorskip("dattri")

from experiments.benchmark.quality import chargpt, digits, metrics  # noqa: E402
from experiments.benchmark.quality import ground_truth as gtm  # noqa: E402
from experiments.benchmark.quality.common import (  # noqa: E402
    Setting,
    TrainObserver,
    TupleDataset,
    lm_functions,
    per_sample_ce,
    seed_all,
)
from experiments.benchmark.quality.methods import (  # noqa: E402
    Context,
    Method,
    ours,
    reference,
    run_method,
    trajectory,
)

NUM_SUBSETS = 10
pytestmark = pytest.mark.slow  # minutes on the shared 2-core machine


def _ok(method: Method, ctx: Context) -> torch.Tensor:
    r = run_method(method, ctx)
    assert r.status == "ok", r.note
    return r.scores


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    torch.set_num_threads(1)
    setting = digits.make_setting("digits-lr")
    folder = tmp_path_factory.mktemp("quality")
    ckpts, _ = gtm.reference_run(setting, folder, seed=0)
    gt, _ = gtm.lds_ground_truth(setting, folder, NUM_SUBSETS, runs=2, seed=1000)
    return setting, Context(setting, ckpts), gt


def test_ground_truth_layout_and_reliability(fixture):
    setting, _, gt = fixture
    assert gt["gt"].shape == (NUM_SUBSETS, len(setting.test))
    assert gt["indices"].shape == (NUM_SUBSETS, len(setting.train) // 2)
    # dattri flips the sign and averages the runs: gt == -mean(per-run test loss)
    torch.testing.assert_close(gt["gt"], gt["per_run"].mean(1), rtol=1e-6, atol=1e-6)
    assert metrics.split_run_reliability(gt["per_run"])["mean"] > 0.8  # LR retraining is stable


def test_vectorised_spearman_matches_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 7)), rng.normal(size=(12, 7))
    a[3, 2] = a[5, 2]  # a tie
    want = [spearmanr(a[:, j], b[:, j]).correlation for j in range(7)]
    np.testing.assert_allclose(metrics.spearman_columns(a, b), want, rtol=1e-12)


def test_grad_dot_equals_brute_force(fixture):
    setting, ctx, _ = fixture
    got = _ok(ours.methods(quick=True)[0], ctx)  # Grad-Dot
    g_train = reference.per_sample_flat_grads(ctx, ctx.final, setting.train)
    g_test = reference.per_sample_flat_grads(ctx, ctx.final, setting.test)
    want = g_train @ g_test.T
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # float32 model


def test_influence_beats_grad_dot_and_random_is_zero(fixture):
    _, ctx, gt = fixture

    def lds(method: Method) -> float:
        return metrics.lds_metric(_ok(method, ctx), gt)["mean"]

    lds_random, lds_exact = lds(reference.METHODS[0]), lds(reference.METHODS[1])
    lds_grad_dot = lds(ours.methods(quick=True)[0])
    assert abs(lds_random) < 0.08
    assert lds_exact > 0.8
    assert lds_exact > lds_grad_dot + 0.2
    ekfac = Method("EK-FAC", "dattri_llm", ours.kronecker("EKFACAttributor", 1e-3))
    assert lds(ekfac) > lds_grad_dot + 0.1


# ---- language-model settings ---------------------------------------------------------------
def test_chargpt_clean_play_keeps_speeches_only():
    md = (
        "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again  \nIn thunder, _aside_ or in rain?\n\n"
        "**ALL**  \nFair is foul, and foul is fair:  \nHover through the fog.\n\n_Exeunt_\n"
    )
    assert chargpt.clean_play(md) == (
        "First Witch:\nWhen shall we three meet again\nIn thunder, or in rain?\n\n"
        "ALL:\nFair is foul, and foul is fair:\nHover through the fog."
    )


def test_chargpt_stream_is_seeded_permutations_of_the_subset():
    sub = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:150].sort().values
    stream = torch.cat(chargpt.batch_stream(sub, 3))
    gen = torch.Generator().manual_seed(3)
    want = torch.cat([sub[torch.randperm(150, generator=gen)] for _ in range(33)])
    assert torch.equal(stream, want[: chargpt.HP["steps"] * chargpt.HP["batch_size"]])


def _lm_grad_dot(model: torch.nn.Module, make_model, test_loss, measure=None) -> None:
    """dattri_llm's Grad-Dot on an LM setting over ``model`` equals torch.func per-sample
    gradients of the train loss and of ``test_loss(p, x, y)``, float64."""
    vocab, t = model(torch.zeros(1, 8, dtype=torch.long)).shape[-1], 8
    x, y = torch.randint(0, vocab, (14, t)), torch.randint(0, vocab, (14, t))
    train, test = TupleDataset(x[:10], y[:10]), TupleDataset(x[10:], y[10:])
    fns = {k: v for k, v in lm_functions(measure).items() if k in ("loss_sum", "target_sum")}
    setting = Setting("tiny", train, test, make_model, None, None, make_loss_single=None,
                      batch_size=4, task_kind="lm", **fns)  # fmt: skip
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    got = _ok(ours.methods(quick=True, classifier=False)[0], Context(setting, [state]))
    params = {k: v.detach() for k, v in model.named_parameters()}  # a tied matrix once

    def ce(p, xi, yi):
        return per_sample_ce(lambda i: functional_call(model, p, (i,)), xi[None], yi[None])[0]

    def flat(fn, ds):
        g = vmap(grad(fn), in_dims=(None, 0, 0))(params, ds.x, ds.y)
        return torch.cat([g[k].reshape(len(ds.x), -1) for k in params], 1)

    want = flat(ce, train) @ flat(lambda p, xi, yi: test_loss(ce(p, xi, yi)), test).T
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * want.abs().max().item())


def test_chargpt_grad_dot_equals_brute_force_per_sample_gradients():
    """All layers: embeddings with a batched position index, LayerNorms, linears."""
    torch.manual_seed(0)

    def make():
        return chargpt.CharGPT(11, block_size=8, n_layer=1, n_head=2, n_embd=8).double()

    _lm_grad_dot(make(), make, lambda ce: ce)


def test_gpt2_grad_dot_with_log_odds_target_equals_brute_force():
    """A tiny ``GPT2LMHeadModel`` (Conv1D, tied wte / lm_head) with dattri's log-odds target,
    written out: ``-(log p - log(1 - p))``, ``p = exp(-CE)``."""
    pytest.importorskip("transformers")
    from experiments.benchmark.quality.gpt2 import TinyGPT2, neg_log_odds

    torch.manual_seed(0)

    def make():
        return TinyGPT2(13, n_layer=1, n_head=2, n_embd=8).double()

    model = make()
    assert model.gpt.lm_head.weight is model.gpt.transformer.wte.weight  # tied

    def log_odds_loss(ce):
        prob = torch.exp(-ce)
        return -(torch.log(prob) - torch.log(1 - prob))

    _lm_grad_dot(model, make, log_odds_loss, neg_log_odds)


def test_chargpt_observer_and_mask_index_follow_the_trajectory_contract(monkeypatch):
    """An observer sees every update and leaves the weights bit-identical; ``mask_index``
    drops that sample from every batch of the same stream and equals a masked AdamW loop
    written out here."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 9, (2, 44, 8), generator=gen)
    blocks = (TupleDataset(x[:40], y[:40]), TupleDataset(x[40:], y[40:]), list("abcdefghi"), {})
    monkeypatch.setattr(chargpt, "make_blocks", lambda: blocks)
    monkeypatch.setattr(chargpt, "BLOCK", 8)
    hp = {**chargpt.HP, "n_layer": 1, "n_head": 2, "n_embd": 8, "steps": 12, "batch_size": 4}
    monkeypatch.setattr(chargpt, "HP", {**hp, "warmup": 3, "checkpoint_steps": [6, 12]})
    setting = chargpt.make_setting("tiny-char")

    class Watch(TrainObserver):
        def __init__(self):
            self.seen, self.after = [], []

        def before_backward(self, step, index, batch):
            assert torch.equal(batch["x"], setting.train.x[index])
            self.seen.append((step, index.clone()))

        def after_step(self, step):
            self.after.append(step)

    loader = DataLoader(setting.train, batch_size=4)
    plain = setting.train_func(loader, seed=5).state_dict()
    watch = Watch()
    observed = setting.train_func(loader, seed=5, observer=watch).state_dict()
    assert all(torch.equal(plain[k], observed[k]) for k in plain)
    assert [s for s, _ in watch.seen] == watch.after == list(range(12))

    drop = int(watch.seen[2][1][1])
    masked_watch = Watch()
    masked = setting.train_func(loader, seed=5, mask_index=drop, observer=masked_watch)
    kept = [idx[idx != drop] for _, idx in watch.seen]
    assert all(torch.equal(a, b) for a, (_, b) in zip(kept, masked_watch.seen, strict=True))
    # the same run written out: nanoGPT init, AdamW groups, schedule, masked batch mean
    seed_all(5)
    model = setting.make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": other}]
    opt = torch.optim.AdamW(groups, lr=hp["lr"], betas=hp["betas"], weight_decay=0.0)
    for step, idx in enumerate(kept, 1):
        for group in opt.param_groups:
            group["lr"] = chargpt.lr_at(step)
        logits = model(setting.train.x[idx])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), setting.train.y[idx].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    want, got = model.state_dict(), masked.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert any(not torch.equal(plain[k], got[k]) for k in plain)  # the removal did something
    half = DataLoader(Subset(setting.train, list(range(0, 40, 2))), batch_size=4)
    with pytest.raises(ValueError, match="mask_index=1 is not a member"):
        setting.train_func(half, seed=5, mask_index=1)


# ---- trajectory methods against brute-force trajectory LOO ---------------------------------
def _short_run(monkeypatch, tmp_path, name: str, epochs: int, n_test: int | None = None, **hp):
    """A digits setting trained for ``epochs``, its reference context, and ``deltas(removed)``:
    the trajectory LOO (each sample masked out of its batches, every epoch)."""
    torch.set_num_threads(1)
    for key, value in {"epochs": epochs, **hp}.items():
        monkeypatch.setitem(digits.HPARAMS[name], key, value)
    setting = digits.make_setting(name)
    if n_test is not None:
        setting.test = TupleDataset(setting.test.x[:n_test], setting.test.y[:n_test])
    ckpts, _ = gtm.reference_run(setting, tmp_path, seed=0)

    def deltas(removed: list[int]) -> np.ndarray:
        gt, _ = gtm.trajectory_loo_ground_truth(setting, tmp_path, removed, 0, ckpts[-1])
        return gt["delta"].numpy()

    return setting, Context(setting, ckpts), deltas


def test_trajectory_rows_on_a_short_sgd_run_track_the_trajectory_loo(monkeypatch, tmp_path):
    """On a 2-epoch digits-MLP SGD run: the recording reproduces the weights bit for bit,
    DVEmb (replayed from parameter snapshots) tracks the trajectory LOO (the harness's removal
    semantics are the trained ones), AdamW-influence is refused."""
    setting, ctx, deltas = _short_run(monkeypatch, tmp_path, "digits-mlp", epochs=2, n_test=40)
    rows = {m.name: run_method(m, ctx) for m in trajectory.methods(True, setting.trajectory)}
    refused = rows.pop("AdamW-influence")
    assert refused.status == "skipped" and "SGD" in refused.note, refused.note
    dvemb = rows["DVEmb (empirical Fisher)"]
    assert dvemb.status == "ok" and "bit-exact" in dvemb.note, dvemb.note
    removed = list(range(0, 1000, 77))
    assert metrics.loo_corr(dvemb.scores[removed].numpy(), deltas(removed)) > 0.85  # measured 0.95


def test_adamw_influence_rows_on_a_short_adamw_run_track_the_trajectory_loo(monkeypatch, tmp_path):
    """AdamW-influence's store path (per-sample gradients offloaded under the hooks, identities
    set per batch, the optimizer recorded around every update) on a 2-epoch AdamW run of the
    digits LR tracks brute-force trajectory LOO (measured 0.977)."""
    hp = {"optimizer": "adamw", "lr": 1e-3, "wd": 0.01}
    _, ctx, deltas = _short_run(monkeypatch, tmp_path, "digits-lr", epochs=2, **hp)
    assert ctx.setting.trajectory == "adamw"
    scores = _ok(trajectory.methods(True, "adamw")[0], ctx)  # every step, all coordinates
    removed = list(range(0, 1000, 50))
    assert metrics.loo_corr(scores[removed].numpy(), deltas(removed)) > 0.9
