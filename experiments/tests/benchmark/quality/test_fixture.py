"""CI-sized attribution-quality fixture: digits-LR, dattri's LDS protocol with a few subsets.

A real check that the attributors rank training data correctly (not just that they run): the
exact-Hessian influence function and EK-FAC must beat Grad-Dot's LDS, and random scores must
sit at ~0. Ground truth comes from dattri 0.3.0's own ``retrain_lds`` /
``calculate_lds_ground_truth``; the LDS is dattri's ``lds``. The char-GPT setting's pieces
that need no download (play cleaning, the common-random-numbers batch stream, per-sample
gradients of the char model) are checked at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("dattri")

from experiments.benchmark.quality import ground_truth as gtm  # noqa: E402
from experiments.benchmark.quality.digits import make_setting  # noqa: E402
from experiments.benchmark.quality.methods import (  # noqa: E402
    Context,
    ours,
    reference,
    run_method,
)
from experiments.benchmark.quality.metrics import (  # noqa: E402
    lds_metric,
    spearman_columns,
    split_run_reliability,
)
from experiments.tests.helpers import tiny_chargpt  # noqa: E402

NUM_SUBSETS = 10
pytestmark = pytest.mark.slow  # ~20 s CPU, ~45 s wall on the shared 2-core machine


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    torch.set_num_threads(1)
    setting = make_setting("digits-lr")
    folder = tmp_path_factory.mktemp("quality")
    ckpts, _ = gtm.reference_run(setting, folder, seed=0)
    gt, _ = gtm.lds_ground_truth(setting, folder, NUM_SUBSETS, runs=2, seed=1000)
    return setting, Context(setting, ckpts), gt


def _lds(ctx, gt, method):
    r = run_method(method, ctx)
    if r.status == "pending":
        pytest.skip(f"{method.name}: {r.note}")
    assert r.status == "ok", r.note
    return r.scores, lds_metric(r.scores, gt)["mean"]


def test_ground_truth_layout_and_reliability(fixture):
    setting, _, gt = fixture
    assert gt["gt"].shape == (NUM_SUBSETS, len(setting.test))
    assert gt["indices"].shape == (NUM_SUBSETS, len(setting.train) // 2)
    # dattri flips the sign and averages the runs: gt == -mean(per-run test loss)
    torch.testing.assert_close(gt["gt"], gt["per_run"].mean(1), rtol=1e-6, atol=1e-6)
    assert split_run_reliability(gt["per_run"])["mean"] > 0.8  # LR retraining is stable


def test_vectorised_spearman_matches_scipy():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 7)), rng.normal(size=(12, 7))
    a[3, 2] = a[5, 2]  # a tie
    want = [spearmanr(a[:, j], b[:, j]).correlation for j in range(7)]
    np.testing.assert_allclose(spearman_columns(a, b), want, rtol=1e-12)


def test_grad_dot_equals_brute_force(fixture):
    setting, ctx, _ = fixture
    r = run_method(ours.methods(quick=True)[0], ctx)  # Grad-Dot
    if r.status == "pending":
        pytest.skip(r.note)
    assert r.status == "ok", r.note
    g_train = reference.per_sample_flat_grads(ctx, ctx.final, setting.train)
    g_test = reference.per_sample_flat_grads(ctx, ctx.final, setting.test)
    want = g_train @ g_test.T
    assert (r.scores - want).abs().max() <= 1e-4 * want.abs().max()  # float32 model


def test_influence_beats_grad_dot_and_random_is_zero(fixture):
    _, ctx, gt = fixture
    _, lds_random = _lds(ctx, gt, reference.METHODS[0])
    _, lds_exact = _lds(ctx, gt, reference.METHODS[1])
    _, lds_grad_dot = _lds(ctx, gt, ours.methods(quick=True)[0])
    assert abs(lds_random) < 0.08
    assert lds_exact > 0.8
    assert lds_exact > lds_grad_dot + 0.2
    ekfac = ours.Method("EK-FAC", "dattri_llm", ours.kronecker("EKFACAttributor", 1e-3))
    _, lds_ekfac = _lds(ctx, gt, ekfac)
    assert lds_ekfac > lds_grad_dot + 0.1


# ---- char-GPT setting: pieces that need no download ----------------------------------------
def test_chargpt_clean_play_keeps_speeches_only():
    from experiments.benchmark.quality.chargpt import clean_play

    md = (
        "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n"
        "**First Witch**  \nWhen shall we three meet again  \nIn thunder, _aside_ or in rain?\n\n"
        "**ALL**  \nFair is foul, and foul is fair:  \nHover through the fog.\n\n_Exeunt_\n"
    )
    assert clean_play(md) == (
        "First Witch:\nWhen shall we three meet again\nIn thunder, or in rain?\n\n"
        "ALL:\nFair is foul, and foul is fair:\nHover through the fog."
    )


def test_chargpt_crn_stream_is_the_full_stream_restricted_to_the_subset():
    from experiments.benchmark.quality.chargpt import HP, batch_stream

    n = 300
    full = torch.arange(n)
    sub = torch.as_tensor(
        sorted(torch.randperm(n, generator=torch.Generator().manual_seed(1))[:150].tolist())
    )
    independent_full = torch.cat(batch_stream(full, n, 3, crn=False))
    crn_full = torch.cat(batch_stream(full, n, 3, crn=True))
    assert torch.equal(independent_full, crn_full)  # one reference run serves both variants
    crn_sub = torch.cat(batch_stream(sub, n, 3, crn=True))
    assert len(crn_sub) == HP["steps"] * HP["batch_size"]
    members = set(sub.tolist())
    # the same permutation stream (epochs of randperm(n)) with non-members skipped
    gen = torch.Generator().manual_seed(3)
    want: list[int] = []
    while len(want) < len(crn_sub):
        want += [i for i in torch.randperm(n, generator=gen).tolist() if i in members]
    assert crn_sub.tolist() == want[: len(crn_sub)]
    ind_sub = torch.cat(batch_stream(sub, n, 3, crn=False))
    assert set(ind_sub.tolist()) <= members and not torch.equal(ind_sub, crn_sub)


def test_chargpt_grad_dot_equals_brute_force_per_sample_gradients():
    """dattri_llm's Grad-Dot on the char model (all layers: embeddings with a batched position
    index, LayerNorms, linears) equals torch.func per-sample gradients, float64."""
    from torch.func import functional_call, grad, vmap

    from experiments.benchmark.quality.chargpt import CharGPT
    from experiments.benchmark.quality.common import Setting, TupleDataset

    torch.manual_seed(0)
    vocab, t = 11, 8
    model = CharGPT(vocab, block_size=t, n_layer=1, n_head=2, n_embd=8).to(torch.float64)
    x = torch.randint(0, vocab, (14, t))
    y = torch.randint(0, vocab, (14, t))
    train, test = TupleDataset(x[:10], y[:10]), TupleDataset(x[10:], y[10:])

    def per_sample(m, xb, yb):
        return torch.nn.functional.cross_entropy(m(xb).transpose(1, 2), yb, reduction="none").mean(
            1
        )

    def loss_sum(m, batch):
        return per_sample(m, batch["x"], batch["y"]).sum()

    setting = Setting(
        name="tiny-char",
        train=train,
        test=test,
        make_model=lambda: CharGPT(vocab, t, 1, 2, 8).to(torch.float64),
        train_func=None,
        target=None,
        loss_sum=loss_sum,
        make_loss_single=None,
        batch_size=4,
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    r = run_method(ours.methods(quick=True, classifier=False)[0], Context(setting, [state]))
    if r.status == "pending":
        pytest.skip(r.note)
    assert r.status == "ok", r.note
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return per_sample(lambda inp: functional_call(model, p, (inp,)), xi[None], yi[None]).sum()

    def flat(ds):
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, ds.x, ds.y)
        return torch.cat([g[k].reshape(len(ds.x), -1) for k in params], 1)

    want = flat(train) @ flat(test).T
    torch.testing.assert_close(r.scores, want, rtol=1e-9, atol=1e-12 * want.abs().max().item())


def test_chargpt_observer_and_mask_index_follow_the_trajectory_contract(monkeypatch):
    """char-gpt's loop takes ``observer=`` / ``mask_index=`` (gpt2's semantics): an observer
    sees every update and leaves the weights bit-identical; ``mask_index`` drops that sample
    from every batch of the same stream and equals a masked AdamW loop written out here."""
    from torch.utils.data import DataLoader, Subset

    from experiments.benchmark.quality.common import TrainObserver, seed_all

    chargpt, setting = tiny_chargpt(monkeypatch)
    assert setting.trajectory == "adamw"

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
    for (_, full_idx), (_, idx) in zip(watch.seen, masked_watch.seen, strict=True):
        assert torch.equal(idx, full_idx[full_idx != drop])
    # the same run written out: nanoGPT init, AdamW groups, schedule, masked batch mean
    seed_all(5)
    model = setting.make_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    hp = chargpt.HP
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp["weight_decay"]}, {"params": other}],
        lr=hp["lr"],
        betas=hp["betas"],
        weight_decay=0.0,
    )
    for step, (_, full_idx) in enumerate(watch.seen, 1):
        idx = full_idx[full_idx != drop]
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


# ---- gpt2 setting: Hugging Face GPT-2 (Conv1D, tied wte / lm_head), log-odds target --------
def test_gpt2_grad_dot_with_log_odds_target_equals_brute_force():
    """dattri_llm's Grad-Dot on a tiny ``GPT2LMHeadModel`` (Conv1D, tied wte / lm_head,
    batched positions) with dattri's log-odds test target equals torch.func, float64."""
    pytest.importorskip("transformers")
    from torch.func import functional_call, grad, vmap

    from experiments.benchmark.quality.common import Setting, TupleDataset
    from experiments.benchmark.quality.gpt2 import TinyGPT2, neg_log_odds, per_sample_ce

    torch.manual_seed(0)
    vocab, t = 13, 8
    model = TinyGPT2(vocab, n_layer=1, n_head=2, n_embd=8).to(torch.float64)
    assert model.gpt.lm_head.weight is model.gpt.transformer.wte.weight  # tied
    x, y = torch.randint(0, vocab, (14, t)), torch.randint(0, vocab, (14, t))
    train, test = TupleDataset(x[:10], y[:10]), TupleDataset(x[10:], y[10:])
    setting = Setting(
        name="tiny-gpt2",
        train=train,
        test=test,
        make_model=lambda: TinyGPT2(vocab, n_layer=1, n_head=2, n_embd=8).to(torch.float64),
        train_func=None,
        target=None,
        loss_sum=lambda m, b: per_sample_ce(m, b["x"], b["y"]).sum(),
        make_loss_single=None,
        batch_size=4,
        task_kind="lm",
        target_sum=lambda m, b: neg_log_odds(per_sample_ce(m, b["x"], b["y"])).sum(),
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    r = run_method(ours.methods(quick=True, classifier=False)[0], Context(setting, [state]))
    if r.status == "pending":
        pytest.skip(r.note)
    assert r.status == "ok", r.note
    params = {k: v.detach() for k, v in model.named_parameters()}  # wte once (tied)

    def ce(p, xi, yi):
        logits = functional_call(model, p, (xi[None],))[0]
        return torch.nn.functional.cross_entropy(logits, yi)

    def log_odds_loss(p, xi, yi):  # -(log p - log(1 - p)), p = exp(-CE): written out
        prob = torch.exp(-ce(p, xi, yi))
        return -(torch.log(prob) - torch.log(1 - prob))

    def flat(fn, ds):
        g = vmap(grad(fn), in_dims=(None, 0, 0))(params, ds.x, ds.y)
        return torch.cat([g[k].reshape(len(ds.x), -1) for k in params], 1)

    want = flat(ce, train) @ flat(log_odds_loss, test).T
    torch.testing.assert_close(r.scores, want, rtol=1e-9, atol=1e-12 * want.abs().max().item())


# ---- trajectory methods: recording the reference run, DVEmb on an SGD run -----------------------
def _short_run(monkeypatch, name: str, epochs: int, n_test: int | None = None):
    """A digits setting trained for ``epochs``, its reference context, and a function giving
    brute-force trajectory-specific LOO deltas ``(removed, n_test)`` (each sample masked out of
    its batches, every epoch)."""
    from torch.utils.data import DataLoader

    from experiments.benchmark.quality import digits
    from experiments.benchmark.quality.common import TupleDataset

    torch.set_num_threads(1)
    monkeypatch.setitem(digits.HPARAMS[name], "epochs", epochs)
    setting = digits.make_setting(name)
    if n_test is not None:
        setting.test = TupleDataset(setting.test.x[:n_test], setting.test.y[:n_test])
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    model, ckpts = setting.train_func(loader, seed=0, return_checkpoints=True)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    base = setting.target(model, test_loader)

    def deltas(removed: list[int]) -> np.ndarray:
        masked = [setting.train_func(loader, seed=0, mask_index=i) for i in removed]
        return torch.stack([setting.target(m, test_loader) - base for m in masked]).numpy()

    return setting, Context(setting, [*ckpts, final]), deltas


def test_trajectory_rows_on_a_short_sgd_run_track_the_trajectory_loo(monkeypatch):
    """The trajectory adapters on a 2-epoch digits-MLP SGD run: the reference run re-trained
    under the HookManager reproduces the weights bit for bit (the adapter refuses otherwise),
    DVEmb (replayed from parameter snapshots) tracks brute-force trajectory-specific LOO (each
    sample masked out of its batches), and AdamW-influence is refused on an SGD run."""
    from experiments.benchmark.quality.methods import trajectory
    from experiments.benchmark.quality.metrics import loo_corr

    setting, ctx, deltas = _short_run(monkeypatch, "digits-mlp", epochs=2, n_test=40)
    rows = {m.name: run_method(m, ctx) for m in trajectory.methods(True, setting.trajectory)}
    refused = rows.pop("AdamW-influence")
    assert refused.status == "skipped" and "SGD" in refused.note, refused.note
    exact = rows.pop("Exact unrolled influence (explicit per-step Hessians)")
    assert exact.status == "skipped" and "17226 parameters" in exact.note  # digits-LR only
    for name, r in rows.items():
        assert r.status == "ok", (name, r.note)
        assert "bit-exact" in r.note
    removed = list(range(0, 1000, 77))
    delta = deltas(removed)
    corr = {name: loo_corr(r.scores[removed].numpy(), delta) for name, r in rows.items()}
    assert corr["DVEmb (empirical Fisher)"] > 0.85, corr  # measured 0.95


def test_exact_unrolled_influence_equals_trajectory_loo_on_a_short_lr_run(monkeypatch):
    """The reference row of the SGD settings (first-order removal effect unrolled with each
    step's explicit batch Hessian) matches brute-force trajectory-specific LOO on a 4-epoch
    digits-LR run (measured Pearson 0.99995, scale 0.99): the harness's removal semantics
    (mean over the others, every epoch) and the replayed trajectory are the trained ones."""
    from experiments.benchmark.quality.methods import trajectory
    from experiments.benchmark.quality.metrics import loo_corr

    _, ctx, deltas = _short_run(monkeypatch, "digits-lr", epochs=4)
    r = run_method(ours.Method("exact", "reference", trajectory.exact_unroll), ctx)
    assert r.status == "ok", r.note
    removed = list(range(0, 1000, 50))
    delta = deltas(removed)
    scores = r.scores[removed].numpy()
    assert loo_corr(scores, delta) > 0.999
    # relative error 0.024 (first order vs the removal); a batch mean re-normalised over B
    # instead of the B - 1 others gives 0.037
    assert np.linalg.norm(scores - delta) / np.linalg.norm(delta) < 0.03


def test_adamw_influence_rows_on_a_short_adamw_run_track_the_trajectory_loo(monkeypatch):
    """The AdamW-influence adapter's store path (per-sample gradients offloaded while the
    setting's own loop trains under the hooks, identities set with ``set_sample_ids``, the
    optimizer recorded around every update, ``loss_reduction="mean"``) on a 2-epoch AdamW run
    of the digits LR (a test-only variant of the setting) tracks brute-force trajectory-specific
    LOO (measured 0.977, scale 0.93)."""
    from experiments.benchmark.quality import digits
    from experiments.benchmark.quality.methods import trajectory
    from experiments.benchmark.quality.metrics import loo_corr

    for key, value in {"optimizer": "adamw", "lr": 1e-3, "wd": 0.01}.items():
        monkeypatch.setitem(digits.HPARAMS["digits-lr"], key, value)
    setting, ctx, deltas = _short_run(monkeypatch, "digits-lr", epochs=2)
    assert setting.trajectory == "adamw"
    r = run_method(trajectory.methods(True, "adamw")[0], ctx)  # every step, all coordinates
    assert r.status == "ok", r.note
    removed = list(range(0, 1000, 50))
    assert loo_corr(r.scores[removed].numpy(), deltas(removed)) > 0.9
