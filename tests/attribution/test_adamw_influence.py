"""AdamW-influence against explicit unrolled formulas, the exact derivative and real retraining.

References (``trajectory_reference``), all float64 on a 2-layer MLP trained for 4 captured steps
(10 samples, two of them seen twice) after a real warm-up of the optimizer:

* the explicit forward-mode formula: per step a dense (3P or 4P)² Jacobian of torch's Adam /
  AdamW update written out by hand for θ, m, v (and v_max with AMSGrad), with the step's
  empirical Fisher κ Σ s sᵀ as curvature, and a dense push of −s_z at the sample's step;
* the exact derivative −∂ℓ_q(θ_T)/∂w_z by autograd (double backward) through an explicitly
  unrolled, differentiable copy of the training loop (checked to reproduce the real run);
* leave-one-out retraining with that unrolled loop.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dattri_llm import (
    AdamWInfluenceAttributor,
    GradientStorageManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
    ProjectionConfig,
    ReplayGradientSource,
)
from dattri_llm.gradient.ops.projection import mask_indices
from tests.helpers.adamw_run import (
    CONFIGS,
    SCHEDULE,
    N,
    Q,
    args,
    compare_occurrences,
    data,
    library,
    make_run,
    occurrences,
)
from tests.helpers.trajectory import (
    DT,
    Hyper,
    adam_step,
    adam_step_matrices,
    clip_coef,
    exact_scores,
    fro_rel,
    loo_scores,
    make_mlp,
    matrix_order,
    mlp_sample_losses,
    pearson,
    query_grads,
    rel_err,
    unroll_explicit,
    unrolled_final,
)


# ---- the references themselves -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_reproduces_the_run_and_its_linearisation(tmp_path, name):
    run = make_run(tmp_path, name, clip_factors=[0.3, 1.0, 0.6, 0.9])
    # the unrolled copy of the loop is the real run
    theta = unrolled_final(run, torch.ones(N, dtype=DT), create_graph=False)
    assert rel_err(theta.detach(), run.thetas[-1]) <= 1e-12
    # the recorded post-states follow from the hand-written step
    for t in range(len(SCHEDULE)):
        pre, post = run.pre[t], run.post[t]
        th, m, v, vmax = adam_step(
            run.thetas[t],
            pre["m"],
            pre["v"],
            pre["vmax"],
            run.consumed[t],
            pre["count"] + 1,
            run.hyper,
            run.lrs[t],
        )
        assert rel_err(th, run.thetas[t + 1]) <= 1e-12
        assert rel_err(m, post["m"]) <= 1e-12 and rel_err(v, post["v"]) <= 1e-12
    # the hand-written Jacobians equal autograd's of the hand-written step (linear gradient model)
    t = 2
    J, D, Jc, S = adam_step_matrices(run, t)
    pre, P = run.pre[t], run.flat.P
    H = S.T @ S
    th0 = run.thetas[t]

    def step(theta, m, v, vmax, dg):
        g = run.consumed[t] + Jc @ H @ (theta - th0) + dg
        out = adam_step(theta, m, v, vmax, g, pre["count"] + 1, run.hyper, run.lrs[t])
        return out if run.hyper.amsgrad else out[:3]

    vm = pre["vmax"] if run.hyper.amsgrad else torch.zeros(P, dtype=DT)
    jac = torch.autograd.functional.jacobian(
        step, (th0, pre["m"], pre["v"], vm, torch.zeros(P, dtype=DT))
    )
    nb = 4 if run.hyper.amsgrad else 3
    auto_J = torch.cat([torch.cat([jac[r][c] for c in range(nb)], dim=1) for r in range(nb)])
    auto_D = torch.cat([jac[r][4] for r in range(nb)])
    assert rel_err(J, auto_J) <= 1e-12 and rel_err(D, auto_D) <= 1e-12


# ---- the explicit formula ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,reduction",
    [("adamw", "sum"), ("adamw", "mean"), ("adam_coupled_wd", "sum"), ("adamw_amsgrad", "sum")],
)
def test_equals_explicit_forward_mode_formula(tmp_path, name, reduction):
    lrs = [0.02, 0.015, 0.01, 0.01]  # larger steps: the propagation matters
    run = make_run(tmp_path, name, lrs=lrs, reduction=reduction)
    ref, ref_total = unroll_explicit(run, lambda t: adam_step_matrices(run, t), query_grads(run))
    for method in ("adjoint", "forward"):
        score = library(run, tmp_path, method=method)
        assert score.scores.dtype == DT
        assert compare_occurrences(occurrences(score, run), ref) <= 1e-9, method
        assert rel_err(score.query(run.ids, run.qids), ref_total) <= 1e-9
    # non-vacuous: the propagation through later steps changes the scores
    direct = {
        (z, t): query_grads(run)
        @ adam_step_matrices(run, t)[1][: run.flat.P]
        @ -adam_step_matrices(run, t)[3][i]
        for t, idx in enumerate(SCHEDULE)
        for i, z in enumerate(idx)
    }
    assert compare_occurrences(direct, ref) > 1e-3


# ---- the exact derivative and leave-one-out ------------------------------------------------------
# Measured on this file's data (learning rates 2e-3 .. 1e-3, 40 warm-up steps), relative
# Frobenius error of the (N, Q) scores vs the exact derivative / Pearson r with leave-one-out:
#   adamw            1.0e-3 / 0.989   (no curvature term: 1.5e-3; push only, nothing carried: 0.51)
#   adam_coupled_wd  7.3e-4 / 0.968   (9.8e-4; 0.53)
#   adamw_amsgrad    1.5e-3 / 0.980   (2.2e-3; 0.46)
# The exact derivative itself correlates 0.989 / 0.968 / 0.980 with leave-one-out: removing one
# of three samples is a large perturbation of Adam's normalisation (a 5-step warm-up gives 0.95).
# At 10x the learning rates the error grows linearly (1e-2) and r is unchanged.
EXACT_BOUND = 1e-2


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tracks_exact_derivative_and_leave_one_out(tmp_path, name):
    run = make_run(tmp_path, name)
    score = library(run, tmp_path).query(run.ids, run.qids)
    exact = exact_scores(run)
    loo = loo_scores(run)
    err = fro_rel(score, exact)
    corr, corr_exact = pearson(score, loo), pearson(exact, loo)
    q = query_grads(run)
    _, no_curv = unroll_explicit(run, lambda t: adam_step_matrices(run, t, curvature=False), q)
    err_no_curv = fro_rel(no_curv, exact)
    print(
        f"{name}: rel err vs exact {err:.2e} (no curvature {err_no_curv:.2e}); "
        f"corr LOO {corr:.4f} (exact derivative {corr_exact:.4f})"
    )
    assert err <= EXACT_BOUND
    assert err < err_no_curv  # the empirical-Fisher curvature term helps
    assert corr >= 0.95
    for j in range(Q):
        assert pearson(score[:, j], loo[:, j]) >= 0.95
    assert (score[:, 0] > 0).any() and (score[:, 0] < 0).any()  # helpful and harmful samples


def test_tracks_exact_derivative_with_gradient_clipping(tmp_path):
    """Clip factors 0.1-0.8: the library models c(I − uuᵀ); the unrolled reference clips with
    ``clip_grad_norm_``'s own (differentiable) formula."""
    factors = [0.1, 0.35, 0.6, 0.8]
    run = make_run(tmp_path, "adamw", clip_factors=factors)
    coefs = [float(clip_coef(g, m)) for g, m in zip(run.grad_before_clip, run.max_norms)]
    assert all(abs(c - f) < 1e-5 for c, f in zip(coefs, factors))
    got = library(run, tmp_path)
    # explicit formula with the exact Jacobian of clip_grad_norm_ (1e-6 in its denominator)
    ref, ref_total = unroll_explicit(run, lambda t: adam_step_matrices(run, t), query_grads(run))
    err_formula = compare_occurrences(occurrences(got, run), ref)
    score = got.query(run.ids, run.qids)
    exact = exact_scores(run)
    err_exact = fro_rel(score, exact)
    # what ignoring the clipping would give (push −s_z, curvature Ĥ): far off
    blind = dataclasses.replace(run, max_norms=None)
    _, blind_total = unroll_explicit(
        blind, lambda t: adam_step_matrices(blind, t), query_grads(run)
    )
    err_blind = fro_rel(blind_total, exact)
    corr = pearson(score, loo_scores(run))
    print(
        f"clipping: vs explicit {err_formula:.2e}, vs exact {err_exact:.2e}, "
        f"ignoring clipping vs exact {err_blind:.2e}, corr LOO {corr:.4f}"
    )
    assert err_formula <= 1e-5
    assert err_exact <= EXACT_BOUND
    assert err_blind > 10 * err_exact
    assert corr >= 0.95


def test_clipping_refused_when_it_cannot_be_modelled(tmp_path):
    factors = [0.3, 0.5, 0.5, 0.5]
    partial = HookManagerConfig(linear_io=["fc2"])  # fc1 trained but not captured
    run = make_run(tmp_path / "a", "adamw", clip_factors=factors, config=partial)
    assert run.extra["dynamics"].uncovered_parameters == ["fc1.weight", "fc1.bias"]
    with pytest.raises(ValueError, match="clipping") as e:
        library(run, tmp_path / "a")
    assert "fc1.weight" in str(e.value)
    masked = HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=8, seed=0))
    run = make_run(tmp_path / "b", "adamw", clip_factors=factors, config=masked)
    with pytest.raises(ValueError, match="clipping .*masked coordinates"):
        library(run, tmp_path / "b")


def test_mask_capture_equals_full_formula_restricted_to_the_mask(tmp_path):
    """With a per-layer mask the propagated state lives on the masked coordinates: the result is
    the explicit formula with every vector (s, g, m, v, θ, q) restricted to them."""
    masked = HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=8, seed=4))
    run = make_run(tmp_path, "adamw_amsgrad", lrs=[0.02, 0.015, 0.01, 0.01], config=masked)
    # the masked coordinates of each layer's [W | b] matrix form, as flat indices
    order = {layer: matrix_order(run.model, [layer]) for layer in ("fc1", "fc2")}
    coords = torch.cat([o[mask_indices(o.numel(), 8, 4)] for o in order.values()])
    ref, _ = unroll_explicit(
        run, lambda t: adam_step_matrices(run, t, coords), query_grads(run)[:, coords]
    )
    got = library(run, tmp_path)
    assert compare_occurrences(occurrences(got, run), ref) <= 1e-9


def mlp_loss(model, batch):
    return mlp_sample_losses(model(batch["x"]), batch["y"]).sum()


def test_replay_equals_store(tmp_path):
    run = make_run(tmp_path, "adamw_amsgrad", lrs=[0.02, 0.015, 0.01, 0.01], snapshots=True)
    stored = library(run, tmp_path)
    replay = ReplayGradientSource(run.model, run.extra["snaps"], mlp_loss)
    att = AdamWInfluenceAttributor(args(tmp_path), loss_reduction="sum")
    replayed = att.attribute_from_cache(replay, tmp_path / "query", dynamics=run.extra["dynamics"])
    assert replayed.train_hashes == stored.train_hashes
    assert rel_err(replayed.scores, stored.scores) <= 1e-10
    # and the replayed gradients are those the run used (explicit formula)
    ref, _ = unroll_explicit(run, lambda t: adam_step_matrices(run, t), query_grads(run))
    assert compare_occurrences(occurrences(replayed, run), ref) <= 1e-9


def test_refusals(tmp_path):
    run = make_run(tmp_path, "adamw")
    att = AdamWInfluenceAttributor(args(tmp_path), loss_reduction="sum")
    with pytest.raises(ValueError, match="needs dynamics="):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "query")
    with pytest.raises(ValueError, match="loss_reduction"):
        AdamWInfluenceAttributor(args(tmp_path), loss_reduction="avg")
    # an SGD run is DVEmb's
    model = make_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    from tests.helpers.trajectory import record_mlp_run as rec_run

    def cbs(m, o):
        store = GradientStorageManager(tmp_path / "sgd", fsync=False)
        r = OptimizerStateCallback(m, o)
        return [OffloadCallback(file_manager=store), r], {"rec": r}

    sgd = rec_run(model, opt, Hyper("sgd", 0.1), data()[0], SCHEDULE[:2], [0.1, 0.1], cbs)
    with pytest.raises(ValueError, match="DVEmbAttributor"):
        att.attribute_from_cache(
            tmp_path / "sgd", tmp_path / "query", dynamics=sgd.extra["rec"].dynamics()
        )
    # a maximizing optimizer is not modelled
    del run
    model = make_mlp(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, maximize=True)

    def cbs2(m, o):
        store = GradientStorageManager(tmp_path / "max", fsync=False)
        r = OptimizerStateCallback(m, o)
        return [OffloadCallback(file_manager=store), r], {"rec": r}

    mx = rec_run(model, opt, Hyper("adam", 1e-3), data()[0], SCHEDULE[:2], [1e-3, 1e-3], cbs2)
    with pytest.raises(ValueError, match="maximize"):
        att.attribute_from_cache(
            tmp_path / "max", tmp_path / "query", dynamics=mx.extra["rec"].dynamics()
        )


def test_float32_run_with_float64_propagation(tmp_path):
    """A float32 run scored with compute_dtype=float64: the consumed-gradient check follows the
    precision the moments were recorded in (float32), not the compute dtype, and the float64
    result agrees with the float32 one to float32 rounding."""
    from dattri_llm import (
        REGISTER_ALL,
        GradientStorageManager,
        HookManager,
        HookManagerConfig,
        OffloadCallback,
        OptimizerStateCallback,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = OptimizerStateCallback(model, opt)
    cfg = HookManagerConfig(linear_io=REGISTER_ALL)
    store = GradientStorageManager(tmp_path / "tr")
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    hm = HookManager(model, cfg, [OffloadCallback(file_manager=store), rec])
    with hm.collect(deregister_on_exit=True):
        for s in range(8):
            opt.zero_grad()
            b = slice(8 * s, 8 * s + 8)
            torch.nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
            rec.record_post(s)
    hq = HookManager(
        model, cfg, [OffloadCallback(file_manager=GradientStorageManager(tmp_path / "q"))]
    )
    with hq.collect(deregister_on_exit=True):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:4]), y[:4], reduction="sum").backward()
    a = args(tmp_path)
    s32 = AdamWInfluenceAttributor(a, loss_reduction="mean").attribute_from_cache(
        tmp_path / "tr", tmp_path / "q", dynamics=rec.dynamics()
    )
    s64 = AdamWInfluenceAttributor(
        a, loss_reduction="mean", compute_dtype=torch.float64
    ).attribute_from_cache(tmp_path / "tr", tmp_path / "q", dynamics=rec.dynamics())
    assert s32.scores.dtype == torch.float32 and s64.scores.dtype == torch.float64
    assert rel_err(s32.scores.double(), s64.scores) < 1e-3
    # the check itself: a consumed gradient off by float32 rounding (1e-6 relative), computed
    # in float64, is accepted for a float32 record and refused for a float64 one
    g = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    noisy = g + 1e-6 * g.norm() / 1000**0.5 * torch.randn(1000, dtype=torch.float64)
    att, dyn = AdamWInfluenceAttributor(a, loss_reduction="sum"), rec.dynamics()
    assert att._clip(dyn, g, noisy, "test", torch.float32) == (1.0, None)
    with pytest.raises(ValueError, match="not a multiple"):
        att._clip(dyn, g, noisy, "test", torch.float64)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_exact_hessian_equals_the_exact_derivative(tmp_path, name):
    """With ``curvature=ExactHessian(...)`` (each step's true batch-loss Hessian, replayed from
    the snapshots) the first-order influence is the exact derivative of the final query loss:
    equal to autograd through the unrolled run to rounding, also with clipping and masks'
    restriction aside. The empirical Fisher default is measured beside it."""
    from dattri_llm.attribution.trajectory.curvature import ExactHessian

    run = make_run(tmp_path, name, snapshots=True)
    exact = exact_scores(run)
    hessian = ExactHessian(run.model, run.extra["snaps"], mlp_loss)
    got = (
        AdamWInfluenceAttributor(args(tmp_path), loss_reduction="sum", curvature=hessian)
        .attribute_from_cache(
            tmp_path / "train", tmp_path / "query", dynamics=run.extra["rec"].dynamics()
        )
        .query(run.ids, run.qids)
    )
    fisher = library(run, tmp_path).query(run.ids, run.qids)
    print(f"{name}: exact Hessian {fro_rel(got, exact):.1e}, empirical Fisher "
          f"{fro_rel(fisher, exact):.1e}")  # fmt: skip
    assert fro_rel(got, exact) <= 1e-9
    assert fro_rel(fisher, exact) > 1e-6  # non-vacuous: the approximation differs
