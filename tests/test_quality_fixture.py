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
    Pending,
    ours,
    reference,
    run_method,
)
from experiments.benchmark.quality.metrics import (  # noqa: E402
    lds_metric,
    spearman_columns,
    split_run_reliability,
)

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
    try:
        ekfac = ours.kronecker("EKFACAttributor", 1e-3, "sampled")
        _, lds_ekfac = _lds(ctx, gt, ours.Method("EK-FAC", "dattri_llm", ekfac))
    except Pending as e:  # pragma: no cover - before the K-FAC issue lands
        pytest.skip(str(e))
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
