"""TrackStar's options (unit normalization, second-moment correction, mixed fit) vs formulas.

Every reference is written out with explicit float64 matrices: per-sample gradients by
``torch.func`` (``vmap(grad)``), K-FAC / EK-FAC Fishers as dense Kronecker products, Adam's
``exp_avg_sq`` read from the optimizer's own state.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    AttributionTask,
    EKFACAttributor,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    OptimizerStateCallback,
    TracInAttributor,
)
from dattri_llm.attribution.normalization import SecondMoment
from tests.helpers.kronecker import (
    CONFIG,
    LAYERS,
    Oracle,
    T,
    adam_run,
    dataset,
    dense_scores,
    io_oracle,
    kfac_ag,
    loss_fn,
    make_model,
    matrix_form,
    offload,
    rel,
    run_args,
    vmap_grads,
)
from tests.helpers.reference import assert_same_formula

CLASSES = {"kfac": KFACAttributor, "ekfac": EKFACAttributor}


def precond(fisher: torch.Tensor, lam: float) -> torch.Tensor:
    return torch.linalg.inv(fisher + lam * torch.eye(len(fisher), dtype=fisher.dtype))


# ---- (a) unit normalization after the preconditioner ------------------------------------------
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_normalized_kronecker_is_the_cosine_of_the_half_preconditioned_gradients(tmp_path, kind):
    model = make_model()
    train, test = dataset(8, 1), dataset(3, 2)
    oracle = Oracle(model, train, test)
    lam = 1e-2
    num, n_tr, n_te = 0, 0, 0
    for name, (_, _, tr, te, _) in oracle.layers.items():
        p = precond(oracle.fisher(name, kind), lam)
        num = num + tr @ p @ te.T
        n_tr = n_tr + ((tr @ p) * tr).sum(1)
        n_te = n_te + ((te @ p) * te).sum(1)
    ref = num / n_tr.sqrt()[:, None] / n_te.sqrt()[None, :]
    # the same, as TrackStar writes it: cos(P^{1/2} g, P^{1/2} q) with an explicit square root
    half = {}
    for name in oracle.layers:
        ev, q = torch.linalg.eigh(precond(oracle.fisher(name, kind), lam))
        half[name] = q @ torch.diag(ev.sqrt()) @ q.T
    gt = torch.cat([oracle.layers[n][2] @ half[n] for n in oracle.layers], 1)
    qt = torch.cat([oracle.layers[n][3] @ half[n] for n in oracle.layers], 1)
    cos = (gt / gt.norm(dim=1, keepdim=True)) @ (qt / qt.norm(dim=1, keepdim=True)).T
    assert rel(cos, ref) < 1e-10
    task = AttributionTask(loss_fn, model)
    att = CLASSES[kind](run_args(tmp_path), task=task, normalized_grad=True)
    live = att.attribute(train, test, hook_config=CONFIG, damping=lam)
    assert rel(live.query(train, test), ref) < 1e-8
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    cached = CLASSES[kind](run_args(tmp_path), normalized_grad=True)
    got = cached.attribute_from_cache(tr_dir, te_dir, damping=lam).query(train, test)
    assert rel(got, ref) < 1e-8
    # non-vacuous: differs from the plain influence and from Grad-Cos of the raw gradients
    assert rel(got, oracle.scores(kind, lam)) > 1e-2
    assert float(got.abs().max()) <= 1 + 1e-12
    with pytest.raises(TypeError, match="normalized_grad"):
        CLASSES[kind](run_args(tmp_path), normalized_grad="yes")


# ---- (c) the preconditioner fit on a mixture of train and query gradients ----------------------
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_mix_fits_on_the_convex_mixture_of_train_and_query_means(tmp_path, kind):
    model = make_model()
    train, test = dataset(8, 1), dataset(3, 2)
    mix, lam = 0.3, 1e-2
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    mask_tr, mask_te = [torch.arange(T) < T - 1] * len(train), [torch.arange(T) < T - 1] * len(test)
    ref = 0
    for name, bias in LAYERS.items():
        mod = getattr(model, name)
        rows_tr = [{"input_ids": d["input_ids"][None]} for d in train]
        rows_te = [{"input_ids": d["input_ids"][None]} for d in test]
        a_tr, g_tr = kfac_ag(io_oracle(model, loss_fn, rows_tr, mod), token_mask=mask_tr)
        a_te, g_te = kfac_ag(io_oracle(model, loss_fn, rows_te, mod), token_mask=mask_te)
        a = (1 - mix) * a_tr + mix * a_te
        g = (1 - mix) * g_tr + mix * g_te
        tr = matrix_form(ps, f"{name}.weight", bias)
        te = matrix_form(pt, f"{name}.weight", bias)
        if kind == "kfac":
            fisher = torch.kron(g, a)
        else:
            q = torch.kron(torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1])
            ev = (1 - mix) * ((tr @ q) ** 2).mean(0) + mix * ((te @ q) ** 2).mean(0)
            fisher = q @ torch.diag(ev) @ q.T
        ref = ref + dense_scores(fisher, te, tr, lam).T
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    att = CLASSES[kind](run_args(tmp_path), mix=mix)
    got = att.attribute_from_cache(tr_dir, te_dir, damping=lam).query(train, test)
    assert rel(got, ref) < 1e-8
    # non-vacuous: the train-only fit differs; mix=0 is the train-only fit
    plain = CLASSES[kind](run_args(tmp_path)).attribute_from_cache(tr_dir, te_dir, damping=lam)
    assert rel(plain.query(train, test), ref) > 1e-3
    zero = CLASSES[kind](run_args(tmp_path), mix=0.0).attribute_from_cache(
        tr_dir, te_dir, damping=lam
    )
    assert_same_formula(zero.query(train, test), plain.query(train, test))
    # the live path streams the test set after the fit: refused with the way out
    live = CLASSES[kind](run_args(tmp_path), task=AttributionTask(loss_fn, model), mix=mix)
    with pytest.raises(ValueError, match="query_source"):
        live.attribute(train, test, hook_config=CONFIG)
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="mix"):
            CLASSES[kind](run_args(tmp_path), mix=bad)


# ---- (b) the optimizer's second moment --------------------------------------------------------


def test_second_moment_from_dynamics_and_optimizer_and_its_scores(tmp_path):
    model = make_model()
    opt, rec, hm = adam_run(model)
    eps = 1e-6
    from_dyn = SecondMoment.from_dynamics(rec.dynamics(), eps=eps)
    from_opt = SecondMoment.from_optimizer(opt, hm, eps=eps)
    hm.remove()
    # the optimizer's own exp_avg_sq in the [W | b] matrix form, written out
    d = {}
    for name, bias in LAYERS.items():
        mod = getattr(model, name)
        st = {"w": opt.state[mod.weight]["exp_avg_sq"][None]}
        v = matrix_form(
            {"w": st["w"], "b": opt.state[mod.bias]["exp_avg_sq"][None]} if bias else st,
            "w",
            "b" if bias else None,
        )[0]
        assert torch.equal(from_dyn.v[name], v) and torch.equal(from_opt.v[name], v)
        d[name] = 1.0 / (v + eps).sqrt()
    train, test = dataset(7, 1), dataset(3, 2)
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    tr = torch.cat([matrix_form(ps, f"{n}.weight", b) * d[n] for n, b in LAYERS.items()], 1)
    te = torch.cat([matrix_form(pt, f"{n}.weight", b) * d[n] for n, b in LAYERS.items()], 1)
    ref_dot = tr @ te.T
    ref_cos = (tr / tr.norm(dim=1, keepdim=True)) @ (te / te.norm(dim=1, keepdim=True)).T
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    a = run_args(tmp_path)
    dot = TracInAttributor(a, second_moment=from_dyn).attribute_from_cache(tr_dir, te_dir)
    assert rel(dot.query(train, test), ref_dot) < 1e-10
    cos = TracInAttributor(a, second_moment=from_opt, normalized_grad=True)
    assert rel(cos.attribute_from_cache(tr_dir, te_dir).query(train, test), ref_cos) < 1e-10
    live = TracInAttributor(a, task=AttributionTask(loss_fn, model), second_moment=from_dyn)
    assert rel(live.attribute(train, test, hook_config=CONFIG).query(train, test), ref_dot) < 1e-10
    with pytest.raises(ValueError, match="attribution_granularity='sample'"):
        live.attribute(train, test, hook_config=CONFIG, attribution_granularity="token")
    # non-vacuous: the correction changes the scores
    raw = TracInAttributor(a).attribute_from_cache(tr_dir, te_dir).query(train, test)
    assert rel(raw, ref_dot) > 1e-2


def test_second_moment_refuses_mixing_projections_and_bad_input(tmp_path):
    from dattri_llm import GradientStorageManager, OffloadCallback, ProjectionConfig

    model = make_model()
    opt, rec, hm = adam_run(model, steps=1)
    hm.remove()
    sm = SecondMoment.from_dynamics(rec.dynamics())
    cfg = HookManagerConfig(
        linear_io=["fc", "head"], projection=ProjectionConfig(style="dense", proj_dim=4, seed=0)
    )
    paths = []
    for side, ds in (("tr", dataset(4, 1)), ("te", dataset(2, 2))):
        fm = GradientStorageManager(str(tmp_path / side))
        h = HookManager(model, cfg, callbacks=[OffloadCallback(file_manager=fm)])
        with h.collect():
            model.zero_grad()
            loss_fn(model, {"input_ids": torch.stack([d["input_ids"] for d in ds])}).backward()
        h.remove()
        fm.close()
        paths.append(str(tmp_path / side))
    att = TracInAttributor(run_args(tmp_path), second_moment=sm)
    with pytest.raises(ValueError, match="mixes coordinates"):
        att.attribute_from_cache(*paths)
    with pytest.raises(ValueError, match="eps"):
        SecondMoment(sm.v, eps=0.0)
    with pytest.raises(ValueError, match="negative"):
        SecondMoment({"fc": -torch.ones(3)})
    with pytest.raises(TypeError, match="second_moment"):
        TracInAttributor(run_args(tmp_path), second_moment={"fc": torch.ones(3)})
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    rec2 = OptimizerStateCallback(model, sgd)
    h = HookManager(model, CONFIG, callbacks=[rec2])
    with h.collect():
        model.zero_grad()
        loss_fn(
            model, {"input_ids": torch.stack([d["input_ids"] for d in dataset(2, 3)])}
        ).backward()
        sgd.step()
        rec2.record_post(0)
    h.remove()
    with pytest.raises(ValueError, match="no second moment"):
        SecondMoment.from_dynamics(rec2.dynamics())


# ---- (a) on the trajectory methods: each sample's whole displacement and each query ----------
def test_normalized_dvemb_is_the_cosine_of_summed_embeddings_and_queries(tmp_path):
    from dattri_llm import AdamWInfluenceAttributor, DVEmbAttributor
    from tests.helpers.dvemb_run import LRS, args, compare, make_run, occurrences, product_formula
    from tests.helpers.trajectory import query_grads, rel_err

    run = make_run(tmp_path)
    emb = product_formula(run)  # {(z, t): e_t(z)}, written out with explicit P x P matrices
    q = query_grads(run)
    totals: dict[int, torch.Tensor] = {}
    for (z, _), e in emb.items():
        totals[z] = totals.get(z, 0) + e
    qn = q / q.norm(dim=1, keepdim=True)
    ref = {(z, t): qn @ e / totals[z].norm() for (z, t), e in emb.items()}
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum", normalized_grad=True)
    got = att.attribute_from_cache(tmp_path / "train", tmp_path / "query", learning_rate=LRS)
    assert compare(occurrences(got, run), ref) <= 1e-9
    # a sample's rows sum to the cosine of its whole displacement with the query
    ids, mat = got.agnostic_matrix()
    cols = [got.test_hashes.index(h) for h in run.qids]
    cos = torch.stack(
        [qn @ totals[run.ids.index(h)] / totals[run.ids.index(h)].norm() for h in ids]
    )
    assert rel_err(mat[:, cols], cos) <= 1e-9
    plain = {(z, t): q @ e for (z, t), e in emb.items()}
    assert compare(ref, plain) > 1e-2  # non-vacuous
    for cls in (DVEmbAttributor, AdamWInfluenceAttributor):
        with pytest.raises(ValueError, match="forward"):
            cls(args(tmp_path), method="adjoint", normalized_grad=True)
