"""DVEmb against the explicit product formula and explicit unrolled SGD Jacobians.

References (``trajectory_reference``), float64, a 2-layer MLP trained by a hand-written SGD loop
for 4 captured steps (10 samples, two seen twice):

* plain SGD: e_t(z) = η_t (I − η_{T−1} H_{T−1}) ⋯ (I − η_{t+1} H_{t+1}) s_z with explicit P×P
  matrices H_k = κ Σ_{z∈B_k} s_z s_zᵀ, score = Σ_t ⟨e_t(z), q(θ_T)⟩;
* momentum / dampening / Nesterov / weight decay: explicit 2P×2P Jacobians of torch's SGD step;
* the exact derivative −∂ℓ_q(θ_T)/∂w_z by autograd through the unrolled loop.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    DataValueEmbeddings,
    DVEmbAttributor,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    OptimizerStateCallback,
    ReplayGradientSource,
)
from tests.helpers.dvemb_run import (
    LRS,
    N,
    args,
    compare,
    make_run,
    occurrences,
    product_formula,
    scores_of,
)
from tests.helpers.reference import assert_same_formula
from tests.helpers.trajectory import (
    DT,
    capture_queries,
    exact_scores,
    fro_rel,
    make_mlp,
    matrix_order,
    mlp_sample_losses,
    query_grads,
    rel_err,
    removal,
    sgd_step_matrices,
    shares,
    unroll_explicit,
    unrolled_final,
)


# ---- plain SGD: the product formula --------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_plain_sgd_equals_the_product_formula(tmp_path, reduction):
    run = make_run(tmp_path, reduction=reduction)
    emb = product_formula(run)
    ref = scores_of(emb, query_grads(run))
    tr, te = tmp_path / "train", tmp_path / "query"
    a = args(tmp_path)
    for att, kw in (
        (DVEmbAttributor(a, loss_reduction=reduction), {"learning_rate": LRS}),
        (DVEmbAttributor(a, learning_rate=dict(enumerate(LRS)), loss_reduction=reduction), {}),
        (DVEmbAttributor(a, loss_reduction=reduction, method="adjoint"), {"learning_rate": LRS}),
        (DVEmbAttributor(a, loss_reduction=reduction), {"dynamics": run.extra["dynamics"]}),
    ):
        score = att.attribute_from_cache(tr, te, **kw)
        assert score.scores.dtype == DT
        assert compare(occurrences(score, run), ref) <= 1e-9, (att.method, kw.keys())
    # the embeddings themselves, in the library's layout ([W | b] per layer)
    order = matrix_order(run.model, ["fc1", "fc2"])
    embs = DVEmbAttributor(a, loss_reduction=reduction).embed(tr, learning_rate=LRS)
    got = {
        (run.ids.index(h), s): embs.embeddings[i]
        for i, (h, s) in enumerate(zip(embs.hashes, embs.steps))
    }
    assert compare(got, {k: e[order] for k, e in emb.items()}) <= 1e-9
    # non-vacuous: the propagation matters at these learning rates
    none = DVEmbAttributor(a, curvature="none", loss_reduction=reduction)
    flat_ref = {
        (z, t): run.lrs[t] * query_grads(run) @ removal(run, shares(run, t))[i]
        for t, idx in enumerate(run.schedule)
        for i, z in enumerate(idx)
    }
    s_none = none.attribute_from_cache(tr, te, learning_rate=LRS)
    assert compare(occurrences(s_none, run), flat_ref) <= 1e-9
    assert compare(flat_ref, ref) > 1e-2


# ---- momentum, dampening, Nesterov, weight decay -------------------------------------------------
SGD_CASES = {
    "momentum_dampening_wd": {"momentum": 0.9, "dampening": 0.3, "weight_decay": 0.05},
    "nesterov_wd": {"momentum": 0.8, "nesterov": True, "weight_decay": 0.02},
    "plain_wd": {"weight_decay": 0.1},
}


@pytest.mark.parametrize("case", sorted(SGD_CASES))
@pytest.mark.parametrize("warm", [0, 3])
def test_sgd_momentum_and_weight_decay_equal_explicit_jacobians(tmp_path, case, warm):
    kw = SGD_CASES[case]
    lrs = [0.1, 0.08, 0.06, 0.05]
    run = make_run(tmp_path, opt_kw=kw, lrs=lrs, warm=warm)
    ref, _ = unroll_explicit(run, lambda t: sgd_step_matrices(run, t), query_grads(run))
    tr, te, a = tmp_path / "train", tmp_path / "query", args(tmp_path)
    for method in ("forward", "adjoint"):
        # the recorded run carries the schedule, momentum, dampening and weight decay
        score = DVEmbAttributor(a, loss_reduction="sum", method=method).attribute_from_cache(
            tr, te, dynamics=run.extra["dynamics"]
        )
        assert compare(occurrences(score, run), ref) <= 1e-9, method
    # without a record: the same hyper-parameters given by hand, and whether the momentum
    # buffer existed before the first captured step
    att = DVEmbAttributor(
        a, loss_reduction="sum", learning_rate=lrs, momentum_buffer_existed=warm > 0, **kw
    )
    assert compare(occurrences(att.attribute_from_cache(tr, te), run), ref) <= 1e-9
    # non-vacuous: plain-SGD propagation differs
    plain = DVEmbAttributor(a, loss_reduction="sum").attribute_from_cache(tr, te, learning_rate=lrs)
    assert compare(occurrences(plain, run), ref) > 1e-3


def test_warm_started_dampened_momentum_without_record_is_exact_or_refused(tmp_path):
    kw = SGD_CASES["momentum_dampening_wd"]
    lrs = [0.1, 0.08, 0.06, 0.05]
    run = make_run(tmp_path, opt_kw=kw, lrs=lrs, warm=3)
    ref, _ = unroll_explicit(run, lambda t: sgd_step_matrices(run, t), query_grads(run))
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum", learning_rate=lrs, **kw)
    with pytest.raises(ValueError, match="momentum_buffer_existed"):  # ambiguous: refused
        score = att.attribute_from_cache(tmp_path / "train", tmp_path / "query")
    att = DVEmbAttributor(
        args(tmp_path), loss_reduction="sum", learning_rate=lrs, momentum_buffer_existed=True, **kw
    )
    score = att.attribute_from_cache(tmp_path / "train", tmp_path / "query")
    err = compare(occurrences(score, run), ref)
    print(f"warm-started dampened momentum without dynamics: rel err {err:.3e}")
    assert err <= 1e-9


# ---- errors and warnings -------------------------------------------------------------------------
def test_missing_learning_rate_raises_and_adam_warns(tmp_path):
    run = make_run(tmp_path / "sgd")
    with pytest.raises(ValueError, match="never assumed to be 1") as e:
        DVEmbAttributor(args(tmp_path), loss_reduction="sum").attribute_from_cache(
            tmp_path / "sgd" / "train", tmp_path / "sgd" / "query"
        )
    assert "learning_rate=" in str(e.value)
    with pytest.raises(ValueError, match="learning-rate schedule"):
        DVEmbAttributor(args(tmp_path), loss_reduction="sum").embed(tmp_path / "sgd" / "train")
    del run
    adam = make_run(tmp_path / "adam", lrs=[1e-3] * 4, adam=True)
    with pytest.warns(UserWarning, match="AdamWInfluenceAttributor"):
        DVEmbAttributor(args(tmp_path), loss_reduction="sum").attribute_from_cache(
            tmp_path / "adam" / "train",
            tmp_path / "adam" / "query",
            dynamics=adam.extra["dynamics"],
        )
    with pytest.raises(ValueError, match="curvature"):
        DVEmbAttributor(args(tmp_path), loss_reduction="sum", curvature="gauss_newton")
    with pytest.raises(ValueError, match="curvature_source"):
        DVEmbAttributor(
            args(tmp_path), loss_reduction="sum", curvature="mc_fisher"
        ).attribute_from_cache(
            tmp_path / "sgd" / "train", tmp_path / "sgd" / "query", learning_rate=LRS
        )


# ---- cached embeddings ---------------------------------------------------------------------------
def test_embeddings_saved_and_reloaded_rescore_identically(tmp_path):
    run = make_run(tmp_path)
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum", learning_rate=LRS, method="forward")
    embs = att.embed(tmp_path / "train", save_to=tmp_path / "emb")
    direct = att.attribute_from_cache(tmp_path / "train", tmp_path / "query")
    # the default (method="auto": the adjoint sweep) gives the same scores to rounding
    default = DVEmbAttributor(args(tmp_path), loss_reduction="sum", learning_rate=LRS)
    assert default.method == "adjoint"
    auto = default.attribute_from_cache(tmp_path / "train", tmp_path / "query")
    assert rel_err(auto.scores, direct.scores) <= 1e-12
    loaded = DataValueEmbeddings.load(tmp_path / "emb")
    assert torch.equal(loaded.embeddings, embs.embeddings) and loaded.embeddings.dtype == DT
    assert loaded.hashes == embs.hashes and loaded.steps == embs.steps
    rescored = loaded.score(tmp_path / "query")
    assert_same_formula(rescored.scores, direct.scores)
    # new queries, without the trajectory: equal to the explicit formula
    g = torch.Generator().manual_seed(7)
    XQ2, YQ2 = torch.randn(4, 4, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    capture_queries(run.model, GradientStorageManager(tmp_path / "q2", fsync=False), XQ2, YQ2)
    q2 = run.flat.sample_grads(run.thetas[-1], XQ2, YQ2)
    ref = scores_of(product_formula(run), q2)
    s2 = loaded.score(tmp_path / "q2")
    from dattri_llm.utils.hashing import hash_batch

    cols = [s2.test_hashes.index(h) for h in hash_batch({"input_ids": XQ2})]
    got = {
        (run.ids.index(h), s): s2.scores[i, cols]
        for i, (h, s) in enumerate(zip(s2.train_hashes, s2.train_steps))
    }
    assert compare(got, ref) <= 1e-9


def test_replay_equals_store(tmp_path):
    run = make_run(tmp_path, opt_kw=SGD_CASES["momentum_dampening_wd"], snapshots=True)

    def loss(model, batch):
        return mlp_sample_losses(model(batch["x"]), batch["y"]).sum()

    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum")
    dyn = run.extra["dynamics"]
    stored = att.attribute_from_cache(tmp_path / "train", tmp_path / "query", dynamics=dyn)
    replay = ReplayGradientSource(run.model, run.extra["snaps"], loss)
    replayed = att.attribute_from_cache(replay, tmp_path / "query", dynamics=dyn)
    assert replayed.train_hashes == stored.train_hashes
    assert rel_err(replayed.scores, stored.scores) <= 1e-10


# ---- the Monte-Carlo Fisher curvature ------------------------------------------------------------
def mc_vectors(run) -> list[torch.Tensor]:
    """Per step, vectors V with Vᵀ V = (1/n) Σ_z Σ_draws ŝ ŝᵀ: ŝ the gradient of the loss at a
    sampled label (divided by B for a mean loss: the sample's share), n draws per sample."""
    n = run.extra["draws"]
    out = []
    for t, idx in enumerate(run.schedule):
        labels = run.extra["labels"][t]
        if len(labels) == 1:
            x = run.X[idx].repeat_interleave(n, 0)
        else:
            x = torch.cat([run.X[idx]] * len(labels))
        v = run.flat.sample_grads(run.thetas[t], x, torch.cat(labels))
        if run.reduction == "mean":
            v = v / len(idx)
        out.append(v / n**0.5)
    return out


@pytest.mark.parametrize(
    "reduction,micro",
    [("sum", False), ("sum", True), ("mean", True)],
    ids=["sum", "sum-micro", "mean-micro"],
)
def test_mc_fisher_equals_the_formula_with_the_sampled_vectors(tmp_path, reduction, micro):
    """Draws as repeated rows of one batch, or (needed for a mean loss, whose share depends on
    the batch size) as micro-batches of one step (``gradient_accumulation_steps``)."""
    run = make_run(tmp_path, curvature_draws=3, reduction=reduction, draws_as_micro_batches=micro)
    ref = scores_of(product_formula(run, curvature=mc_vectors(run)), query_grads(run))
    att = DVEmbAttributor(
        args(tmp_path), learning_rate=LRS, curvature="mc_fisher", loss_reduction=reduction
    )
    for method in ("forward", "adjoint"):
        att.method = method
        score = att.attribute_from_cache(
            tmp_path / "train", tmp_path / "query", curvature_source=tmp_path / "curv"
        )
        assert compare(occurrences(score, run), ref) <= 1e-9, method
    # non-vacuous: it differs from the empirical Fisher
    emp = scores_of(product_formula(run), query_grads(run))
    assert compare(emp, ref) > 1e-3


# Measured on this file's data (plain SGD, sum loss, learning rates 0.3 .. 0.2, 4 steps),
# relative Frobenius error of the (N, Q) scores vs the exact derivative (autograd through the
# unrolled run): empirical Fisher 0.209, Monte-Carlo Fisher (32 draws per sample and step)
# 0.119, no curvature 0.488.
def test_mc_fisher_is_closer_to_the_exact_derivative_than_the_empirical_fisher(tmp_path):
    run = make_run(tmp_path, curvature_draws=32)
    # the unrolled reference reproduces the run
    theta = unrolled_final(run, torch.ones(N, dtype=DT), create_graph=False)
    assert rel_err(theta.detach(), run.thetas[-1]) <= 1e-12
    exact = exact_scores(run)
    tr, te = tmp_path / "train", tmp_path / "query"
    a = args(tmp_path)
    emp = DVEmbAttributor(a, loss_reduction="sum", learning_rate=LRS).attribute_from_cache(tr, te)
    mc = DVEmbAttributor(
        a, loss_reduction="sum", learning_rate=LRS, curvature="mc_fisher"
    ).attribute_from_cache(tr, te, curvature_source=tmp_path / "curv")
    none = DVEmbAttributor(
        a, loss_reduction="sum", learning_rate=LRS, curvature="none"
    ).attribute_from_cache(tr, te)
    errs = {
        k: fro_rel(s.query(run.ids, run.qids), exact)
        for k, s in (("empirical_fisher", emp), ("mc_fisher", mc), ("none", none))
    }
    print("DVEmb rel err vs exact derivative:", {k: f"{v:.3e}" for k, v in errs.items()})
    assert errs["mc_fisher"] < errs["empirical_fisher"]
    assert errs["mc_fisher"] < errs["none"]


def test_mc_fisher_mean_loss_with_repeated_rows_is_exact_or_refused(tmp_path):
    """H of a mean training loss is (1/B) Σ_z F_z, F_z ≈ (1/n) Σ_draws ∇ℓ ∇ℓᵀ, however the
    n draws were laid out in the curvature capture."""
    run = make_run(tmp_path, curvature_draws=3, reduction="mean", draws_as_micro_batches=False)
    ref = scores_of(product_formula(run, curvature=mc_vectors(run)), query_grads(run))
    att = DVEmbAttributor(
        args(tmp_path), learning_rate=LRS, curvature="mc_fisher", loss_reduction="mean"
    )
    score = att.attribute_from_cache(
        tmp_path / "train", tmp_path / "query", curvature_source=tmp_path / "curv"
    )
    assert compare(occurrences(score, run), ref) <= 1e-9


def test_recorded_per_group_learning_rates_are_used_and_not_overridden(tmp_path):
    """SGD with two parameter groups (lr 0.1 / 0.02): with dynamics= each coordinate's own
    learning rate enters (checked without curvature, where e = lr ⊙ s exactly); a schedule
    passed beside the record is refused rather than silently overriding it."""
    from dattri_llm import (
        REGISTER_ALL,
        DiskGradientSource,
        GradientStorageManager,
        HookManagerConfig,
    )

    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(
        [{"params": model.fc1.parameters(), "lr": 0.1}, {"params": model.fc2.parameters()}],
        lr=0.02,
    )
    x = torch.randn(6, model.fc1.in_features, dtype=DT)
    y = torch.randint(0, model.fc2.out_features, (6,))
    rec = OptimizerStateCallback(model, opt)
    cfg = HookManagerConfig(linear_io=REGISTER_ALL)
    hm = HookManager(
        model, cfg, [OffloadCallback(file_manager=GradientStorageManager(tmp_path / "tr")), rec]
    )
    with hm.collect(deregister_on_exit=True):
        for step in range(2):
            opt.zero_grad()
            idx = slice(3 * step, 3 * step + 3)
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum").backward()
            opt.step()
            rec.record_post(step)
    xq, yq = torch.randn(2, model.fc1.in_features, dtype=DT), torch.randint(0, 3, (2,))
    hq = HookManager(
        model, cfg, [OffloadCallback(file_manager=GradientStorageManager(tmp_path / "q"))]
    )
    with hq.collect(deregister_on_exit=True):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xq), yq, reduction="sum").backward()
    a = args(tmp_path)
    att = DVEmbAttributor(a, loss_reduction="sum", curvature="none")
    score = att.attribute_from_cache(tmp_path / "tr", tmp_path / "q", dynamics=rec.dynamics())
    # explicit: per-coordinate learning rates over the [W | b] matrix forms of fc1 then fc2
    blocks = list(DiskGradientSource(tmp_path / "tr"))
    q = list(DiskGradientSource(tmp_path / "q"))[0].gradient.flatten()
    p1 = model.fc1.weight.numel() + model.fc1.bias.numel()
    p2 = model.fc2.weight.numel() + model.fc2.bias.numel()
    lr = torch.cat([torch.full((p1,), 0.1, dtype=DT), torch.full((p2,), 0.02, dtype=DT)])
    ref = torch.cat([(b.gradient.flatten() * lr) @ q.T for b in blocks])
    assert rel_err(score.scores, ref) <= 1e-12
    with pytest.raises(ValueError, match="not both"):
        att.attribute_from_cache(
            tmp_path / "tr", tmp_path / "q", dynamics=rec.dynamics(), learning_rate=0.1
        )


@pytest.mark.parametrize("case", ["plain", "momentum_dampening_wd", "nesterov_wd"])
def test_exact_hessian_equals_the_exact_derivative(tmp_path, case):
    """DVEmb with ``curvature=ExactHessian(...)``: the embeddings are the exact first-order
    effect of removing each occurrence (equal to autograd through the unrolled SGD run to
    rounding, momentum and weight decay included); the paper's empirical Fisher beside it."""
    from dattri_llm.attribution.trajectory.curvature import ExactHessian

    kw = SGD_CASES.get(case, {})
    run = make_run(tmp_path, opt_kw=kw, snapshots=True)
    exact = exact_scores(run)

    def loss(model, batch):
        return mlp_sample_losses(model(batch["x"]), batch["y"]).sum()

    hessian = ExactHessian(run.model, run.extra["snaps"], loss)
    tr, te, a = tmp_path / "train", tmp_path / "query", args(tmp_path)
    got = DVEmbAttributor(a, loss_reduction="sum", curvature=hessian).attribute_from_cache(
        tr, te, dynamics=run.extra["dynamics"]
    )
    fisher = DVEmbAttributor(a, loss_reduction="sum").attribute_from_cache(
        tr, te, dynamics=run.extra["dynamics"]
    )
    err, err_fisher = (fro_rel(s.query(run.ids, run.qids), exact) for s in (got, fisher))
    print(f"{case}: exact Hessian {err:.1e}, empirical Fisher {err_fisher:.1e}")
    assert err <= 1e-9
    assert err_fisher > 1e-4


def test_top_k_beyond_the_train_samples_is_every_sample(tmp_path):
    """A trajectory method's ``top_k=10**12`` (reduced from its full result) keeps every one
    of the run's samples, ranked as the full result's ``top_k``."""
    make_run(tmp_path, reduction="sum")
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum")
    tr, te = tmp_path / "train", tmp_path / "query"
    full = att.attribute_from_cache(tr, te, learning_rate=LRS)
    top = att.attribute_from_cache(tr, te, learning_rate=LRS, top_k=10**12)
    n = len(full.agnostic_matrix()[0])
    assert top.top_k_kept == n and top.num_train == n
    assert top.top_k(10**12).proponent_hashes == full.top_k(n).proponent_hashes
    assert top.top_k(n).opponent_hashes == full.top_k(10**12).opponent_hashes
