"""``second_moment=`` on the Fisher family (TrackStar's optimizer correction) vs explicit formulas.

With ``D = diag(1/√(v + ε))`` (``v``: AdamW's ``exp_avg_sq`` read from the optimizer's own
state) and ``g̃ = D g`` (per-sample gradients by ``torch.func``, float64):

* ``ProjectedFisherAttributor``: ``F̃ = (1/N) Σ g̃ g̃ᵀ`` per layer, the score
  ``q̃ᵀ (F̃ + λ I)^{-1} g̃`` with ``torch.linalg.inv``; raw layers and a ``"mask"`` projection
  (the mask's coordinates found by matching the stored vectors to the full gradients);
* ``EKFACAttributor``: ``Q = Q_G ⊗ Q_A`` from the *uncorrected* ``A``, ``G``, eigenvalues
  ``mean_n (Qᵀ g̃_n)²``, the explicit matrix ``Q diag(Λ) Qᵀ`` inverted densely;
* ``normalized_grad=True``: ``q̃ᵀ P g̃ / (√(g̃ᵀ P g̃) √(q̃ᵀ P q̃))``;
* one ``SecondMoment`` per checkpoint through the public ``attribute()``, summed over 3
  checkpoints (TrackStar's full recipe with a mask projection).

Tolerance: ``1e-8`` relative (``1e-10`` where no eigendecomposition is involved).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dattri_llm import (
    AttributionTask,
    CaptureCallback,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    OffloadCallback,
    OptimizerStateCallback,
    ProjectedFisherAttributor,
    ProjectionConfig,
    TracInAttributor,
)
from dattri_llm.attribution.normalization import SecondMoment
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.utils.hashing import hash_sample
from tests.helpers.kronecker import (
    CONFIG,
    LAYERS,
    Oracle,
    T,
    adam_run,
    dataset,
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

EPS = 1e-6
LAM = 1e-2
MASK = HookManagerConfig(
    linear_io=["fc", "head"], projection=ProjectionConfig("mask", proj_dim=5, seed=4)
)


def scales(opt, model) -> dict[str, torch.Tensor]:
    """``1/√(v + ε)`` per layer in the ``[W | b]`` matrix form, from ``opt.state`` directly."""
    out = {}
    for name, bias in LAYERS.items():
        mod = getattr(model, name)
        st = {"w": opt.state[mod.weight]["exp_avg_sq"][None]}
        if bias:
            st["b"] = opt.state[mod.bias]["exp_avg_sq"][None]
        v = matrix_form(st, "w", "b" if bias else None)[0]
        out[name] = 1.0 / (v + EPS).sqrt()
    return out


def inv(fisher: torch.Tensor, lam: float) -> torch.Tensor:
    return torch.linalg.inv(fisher + lam * torch.eye(len(fisher), dtype=fisher.dtype))


def scores(layers: dict, fisher_of, lam: float, normalized: bool) -> torch.Tensor:
    """``Σ_l tr_l P_l te_lᵀ`` (``(N, M)``), or its cosine form, from ``{name: (tr, te)}``."""
    num, n_tr, n_te = 0, 0, 0
    for name, (tr, te) in layers.items():
        p = inv(fisher_of(name, tr), lam)
        num = num + tr @ p @ te.T
        n_tr = n_tr + ((tr @ p) * tr).sum(1)
        n_te = n_te + ((te @ p) * te).sum(1)
    return num / n_tr.sqrt()[:, None] / n_te.sqrt()[None, :] if normalized else num


def exact_fisher(name: str, tr: torch.Tensor) -> torch.Tensor:
    return tr.T @ tr / len(tr)


@pytest.fixture(scope="module")
def run():
    """A model after 3 AdamW steps, its optimizer, the recorded run and the scales."""
    model = make_model()
    opt, rec, hm = adam_run(model)
    sm = SecondMoment.from_optimizer(opt, hm, eps=EPS)
    hm.remove()
    return model, opt, rec, sm, scales(opt, model)


# ---- ProjectedFisherAttributor on raw layers ----------------------------------------------------
@pytest.mark.parametrize("normalized", [False, True])
def test_projected_fisher_is_the_exact_fisher_of_the_corrected_gradients(tmp_path, run, normalized):
    model, _, rec, sm, d = run
    train, test = dataset(8, 1), dataset(3, 2)
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    raw = {
        n: (matrix_form(ps, f"{n}.weight", b), matrix_form(pt, f"{n}.weight", b))
        for n, b in LAYERS.items()
    }
    fixed = {n: (tr * d[n], te * d[n]) for n, (tr, te) in raw.items()}
    ref = scores(fixed, exact_fisher, LAM, normalized)
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    att = ProjectedFisherAttributor(
        run_args(tmp_path), normalized_grad=normalized, second_moment=sm
    )
    got = att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test)
    assert rel(got, ref) < 1e-10
    # the same through the public live path, with the SecondMoment of the recorded run
    live = ProjectedFisherAttributor(
        run_args(tmp_path),
        task=AttributionTask(loss_fn, model),
        normalized_grad=normalized,
        second_moment=SecondMoment.from_dynamics(rec.dynamics(), eps=EPS),
    )
    got = live.attribute(train, test, hook_config=CONFIG, damping=LAM).query(train, test)
    assert rel(got, ref) < 1e-10
    # on a vector layer the correction is a damping metric: (F + λ D^{-2})^{-1} on raw gradients
    if not normalized:
        alt = sum(
            tr @ torch.linalg.inv(exact_fisher(n, tr) + LAM * torch.diag(d[n] ** -2)) @ te.T
            for n, (tr, te) in raw.items()
        )
        assert rel(alt, ref) < 1e-8
    # relative damping: a factor of the corrected Fisher's mean eigenvalue tr(F̃) / P
    rel_ref = 0
    for tr, te in fixed.values():
        f = exact_fisher("", tr)
        rel_ref = rel_ref + tr @ inv(f, 0.1 * float(torch.trace(f)) / len(f)) @ te.T
    if not normalized:
        got = att.attribute_from_cache(tr_dir, te_dir).query(train, test)  # default: 0.1 relative
        assert rel(got, rel_ref) < 1e-10
    # non-vacuous: neither the uncorrected influence nor the raw Fisher applied to corrected
    # gradients (a fit that ignored the correction)
    assert rel(scores(raw, exact_fisher, LAM, normalized), ref) > 1e-2
    raw_fit = {n: raw[n][0] for n in raw}
    wrong = scores(fixed, lambda n, tr: exact_fisher(n, raw_fit[n]), LAM, normalized)
    assert rel(wrong, ref) > 1e-2
    # the preconditioner scores uncorrected train vectors exactly: (D P D q)ᵀ g = q̃ᵀ P g̃
    if not normalized:
        q = Gradient.concatenate([r.gradient for r in capture(model, test, CONFIG)])
        pre = att.preconditioner(damping=LAM)(q)
        got = sum(raw[n][0] @ pre.layers[n].materialize().data.T for n in LAYERS)
        assert rel(got, ref) < 1e-10


def capture(model, ds, cfg) -> list:
    cap = CaptureCallback(keep_all=True)
    hm = HookManager(model, cfg, callbacks=[cap])
    with hm.collect():
        model.zero_grad()
        loss_fn(model, {"input_ids": torch.stack([x["input_ids"] for x in ds])}).backward()
    hm.remove()
    return cap.records


# ---- a "mask" projection: SecondMoment on the mask's coordinates -------------------------------
@pytest.mark.parametrize("cls", [ProjectedFisherAttributor, KFACAttributor, EKFACAttributor])
def test_mask_projection_corrected_fisher(tmp_path, run, cls):
    model, opt, _, _, d = run
    train, test = dataset(8, 1), dataset(3, 2)
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    stored = capture(model, train, MASK)[0].gradient
    hm = HookManager(model, MASK)
    sm = SecondMoment.from_optimizer(opt, hm, eps=EPS)  # laid out on the mask's coordinates
    hm.remove()
    fixed = {}
    for name, bias in LAYERS.items():
        full_tr, full_te = (
            matrix_form(ps, f"{name}.weight", bias),
            matrix_form(pt, f"{name}.weight", bias),
        )
        masked = stored.layers[name].materialize().data  # (N, 5)
        # the mask's coordinates, found independently: the full-gradient column equal to each
        dist = (full_tr[:, :, None] - masked[:, None, :]).abs().sum(0)  # (P_full, 5)
        idx = dist.argmin(0)
        assert float(dist.min(0).values.max()) < 1e-12 and len(set(idx.tolist())) == 5
        assert rel(1.0 / (sm.v[name] + EPS).sqrt(), d[name][idx]) < 1e-12
        fixed[name] = (full_tr[:, idx] * d[name][idx], full_te[:, idx] * d[name][idx])
    tr_dir = offload(model, train, tmp_path / "tr", config=MASK)
    te_dir = offload(model, test, tmp_path / "te", config=MASK)
    for normalized in (False, True):
        ref = scores(fixed, exact_fisher, LAM, normalized)
        att = cls(run_args(tmp_path), normalized_grad=normalized, second_moment=sm)
        got = att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test)
        assert rel(got, ref) < 1e-10, (cls.__name__, normalized)
    # a flat index over the (uncorrected) mask store ranks as the corrected attributor
    if cls is ProjectedFisherAttributor and importlib.util.find_spec("faiss") is not None:
        from dattri_llm import GradientIndex

        att = cls(run_args(tmp_path), second_moment=sm)
        want = att.attribute_from_cache(tr_dir, te_dir, damping=LAM, top_k=3).top_k(3)
        index = GradientIndex.build(tr_dir, tmp_path / "idx", kind="flat")
        got = index.search(te_dir, k=3, preconditioner=att.preconditioner(damping=LAM)).top_k(3)
        assert got.proponent_hashes == want.proponent_hashes
        assert got.opponent_hashes == want.opponent_hashes
    # non-vacuous: without the correction the scores differ
    plain = cls(run_args(tmp_path)).attribute_from_cache(tr_dir, te_dir, damping=LAM)
    assert rel(plain.query(train, test), scores(fixed, exact_fisher, LAM, False)) > 1e-2


# ---- EK-FAC on Kronecker layers: uncorrected basis, corrected eigenvalues -----------------------
@pytest.mark.parametrize("normalized", [False, True])
def test_ekfac_keeps_the_uncorrected_basis_and_fits_corrected_eigenvalues(
    tmp_path, run, normalized
):
    model, _, _, sm, d = run
    train, test = dataset(8, 1), dataset(3, 2)
    oracle = Oracle(model, train, test)
    basis, fixed = {}, {}
    for name, (a, g, tr, te, _) in oracle.layers.items():
        basis[name] = torch.kron(torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1])
        fixed[name] = (tr * d[name], te * d[name])

    def corrected_ekfac(name, tr):
        q = basis[name]
        return q @ torch.diag(((tr @ q) ** 2).mean(0)) @ q.T

    ref = scores(fixed, corrected_ekfac, LAM, normalized)
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    att = EKFACAttributor(run_args(tmp_path), normalized_grad=normalized, second_moment=sm)
    got = att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test)
    assert rel(got, ref) < 1e-8
    live = EKFACAttributor(
        run_args(tmp_path),
        task=AttributionTask(loss_fn, model),
        normalized_grad=normalized,
        second_moment=sm,
    )
    got_live = live.attribute(train, test, hook_config=CONFIG, damping=LAM).query(train, test)
    assert rel(got_live, ref) < 1e-8
    # non-vacuous: the uncorrected EK-FAC, and uncorrected eigenvalues on corrected gradients
    raw = {n: (layer[2], layer[3]) for n, layer in oracle.layers.items()}
    assert rel(scores(raw, lambda n, tr: oracle.fisher(n, "ekfac"), LAM, normalized), ref) > 1e-2
    wrong = scores(fixed, lambda n, tr: oracle.fisher(n, "ekfac"), LAM, normalized)
    assert rel(wrong, ref) > 1e-2
    # ... and the eigenbasis of the corrected gradients' own Fisher is not what is used
    assert rel(scores(fixed, exact_fisher, LAM, normalized), ref) > 1e-3


# ---- persistence: a fit records its correction ---------------------------------------------------
def test_saved_fit_records_the_correction_and_is_refused_without_it(tmp_path, run):
    model, _, _, sm, _ = run
    train, test = dataset(6, 1), dataset(2, 2)
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    att = EKFACAttributor(run_args(tmp_path), second_moment=sm)
    want = att.attribute_from_cache(tr_dir, te_dir, damping=LAM, save_dir=tmp_path / "fit")
    meta = json.loads((tmp_path / "fit" / "checkpoint_0" / "kronecker_factors.json").read_text())
    assert meta["correction"] == sm.fingerprint() and len(sm.fingerprint()) == 64
    again = EKFACAttributor(run_args(tmp_path), second_moment=sm).attribute_from_cache(
        tr_dir, te_dir, damping=LAM, factors=tmp_path / "fit"
    )
    assert_same_formula(again.scores, want.scores)
    with pytest.raises(ValueError, match="corrected by a SecondMoment, and this attributor has"):
        EKFACAttributor(run_args(tmp_path)).attribute_from_cache(
            tr_dir, te_dir, factors=tmp_path / "fit"
        )
    other = SecondMoment(sm.v, eps=2 * EPS)
    assert other.fingerprint() != sm.fingerprint()
    with pytest.raises(ValueError, match="another SecondMoment"):
        EKFACAttributor(run_args(tmp_path), second_moment=other).attribute_from_cache(
            tr_dir, te_dir, factors=att.factors
        )
    plain = EKFACAttributor(run_args(tmp_path))
    plain.fit(tr_dir, save_dir=tmp_path / "raw")
    assert (
        json.loads((tmp_path / "raw" / "checkpoint_0" / "kronecker_factors.json").read_text())[
            "correction"
        ]
        is None
    )
    with pytest.raises(ValueError, match="uncorrected gradients, and this attributor corrects"):
        EKFACAttributor(run_args(tmp_path), second_moment=sm).attribute_from_cache(
            tr_dir, te_dir, factors=tmp_path / "raw"
        )


# ---- refusals ---------------------------------------------------------------------------------
def test_refusals_name_the_fix(tmp_path, run):
    from dattri_llm.gradient.callbacks import KroneckerCovarianceCallback

    model, _, _, sm, _ = run
    train, test = dataset(4, 1), dataset(2, 2)
    cov = KroneckerCovarianceCallback()
    tr_dir = offload(model, train, tmp_path / "tr", callbacks=[cov])
    te_dir = offload(model, test, tmp_path / "te")
    # K-FAC on Kronecker layers cannot reflect the correction: from gradients, or covariances
    for kw in ({}, {"covariances": cov}):
        with pytest.raises(ValueError, match="EKFACAttributor.*ProjectedFisherAttributor"):
            KFACAttributor(run_args(tmp_path), second_moment=sm).attribute_from_cache(
                tr_dir, te_dir, **kw
            )
    # EK-FAC from capture-time covariances is fine on Kronecker layers (basis: uncorrected)
    a = EKFACAttributor(run_args(tmp_path), second_moment=sm)
    b = EKFACAttributor(run_args(tmp_path), second_moment=sm)
    got = a.attribute_from_cache(tr_dir, te_dir, damping=LAM, covariances=cov).scores
    assert rel(got, b.attribute_from_cache(tr_dir, te_dir, damping=LAM).scores) < 1e-10
    # a layer the SecondMoment does not cover; a width that does not match
    only_fc = SecondMoment({"fc": sm.v["fc"]})
    with pytest.raises(ValueError, match="no second moment for layer 'head'"):
        ProjectedFisherAttributor(run_args(tmp_path), second_moment=only_fc).attribute_from_cache(
            tr_dir, te_dir
        )
    narrow = SecondMoment({"fc": sm.v["fc"][:-1], "head": sm.v["head"]})
    with pytest.raises(
        ValueError, match="'fc' has 30 captured coordinates but its second moment 29"
    ):
        EKFACAttributor(run_args(tmp_path), second_moment=narrow).attribute_from_cache(
            tr_dir, te_dir
        )
    # a coordinate-mixing projection
    dense = HookManagerConfig(
        linear_io=["fc", "head"], projection=ProjectionConfig("dense", proj_dim=4, seed=0)
    )
    d_tr = offload(model, train, tmp_path / "dtr", config=dense)
    d_te = offload(model, test, tmp_path / "dte", config=dense)
    for cls in (ProjectedFisherAttributor, KFACAttributor, EKFACAttributor):
        with pytest.raises(ValueError, match="mixes coordinates.*'mask' projection"):
            cls(run_args(tmp_path), second_moment=sm).attribute_from_cache(d_tr, d_te)
    # the corrected gradients have no token axis
    live = EKFACAttributor(
        run_args(tmp_path), task=AttributionTask(loss_fn, model), second_moment=sm
    )
    with pytest.raises(ValueError, match="attribution_granularity='sample'"):
        live.attribute(train, test, hook_config=CONFIG, attribution_granularity="token")
    with pytest.raises(ValueError, match="attribution_granularity='sample'"):
        a.attribute_from_cache(tr_dir, te_dir, attribution_granularity="token")
    # bad arguments
    with pytest.raises(TypeError, match="second_moment"):
        EKFACAttributor(run_args(tmp_path), second_moment={"fc": torch.ones(3)})
    with pytest.raises(ValueError, match="no SecondMoment for checkpoint 1"):
        ProjectedFisherAttributor(run_args(tmp_path), second_moment=[sm])._moment(1)


# ---- several checkpoints: one SecondMoment each, through attribute() --------------------------
def test_per_checkpoint_second_moments_through_attribute(tmp_path):
    """TrackStar's recipe: mask projection, corrected exact Fisher, unit norm, 3 checkpoints."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    rec = OptimizerStateCallback(model, opt)
    hm = HookManager(model, MASK, callbacks=[rec])
    data, states = dataset(12, 7), []
    with hm.collect():
        for s in range(3):
            ids = torch.stack([x["input_ids"] for x in data[4 * s : 4 * s + 4]])
            opt.zero_grad()
            loss_fn(model, {"input_ids": ids}).backward()
            opt.step()
            rec.record_post(s)
            states.append({k: v.clone() for k, v in model.state_dict().items()})
    hm.remove()
    moments = [SecondMoment.from_dynamics(rec.dynamics(), step=s, eps=EPS) for s in range(3)]
    train, test = dataset(6, 1), dataset(2, 2)
    lam = 1.0  # the correction acts through the damping (module docstring): make it count
    fixed = []  # per checkpoint {layer: (D_c m_train, D_c m_test)} (the mask is tested above)
    for c, st in enumerate(states):
        model.load_state_dict(st)
        tr, te = capture(model, train, MASK)[0].gradient, capture(model, test, MASK)[0].gradient
        dd = {n: 1.0 / (moments[c].v[n] + EPS).sqrt() for n in LAYERS}
        fixed.append(
            {
                n: (
                    tr.layers[n].materialize().data * dd[n],
                    te.layers[n].materialize().data * dd[n],
                )
                for n in LAYERS
            }
        )
    ref = sum(scores(f, exact_fisher, lam, True) for f in fixed)
    task = AttributionTask(loss_fn, model, checkpoints=states)

    def recipe(second_moment):
        att = ProjectedFisherAttributor(
            run_args(tmp_path), task=task, normalized_grad=True, second_moment=second_moment
        )
        return att.attribute(train, test, hook_config=MASK, damping=lam).query(train, test)

    assert rel(recipe(moments), ref) < 1e-10
    assert rel(recipe(dict(enumerate(moments))), ref) < 1e-10  # a mapping works too
    # non-vacuous: one SecondMoment for every checkpoint is another recipe
    assert rel(recipe(moments[0]), ref) > 1e-2
    # TracIn takes the same list: Σ_c (D_c g_c)·(D_c q_c)
    tracin = TracInAttributor(run_args(tmp_path), task=task, second_moment=moments)
    got = tracin.attribute(train, test, hook_config=MASK).query(train, test)
    want = sum(tr @ te.T for f in fixed for tr, te in f.values())
    assert rel(got, want) < 1e-10
    # from stores holding the 3 checkpoint labels: the same, and TracIn's top_k (vector scan)
    dirs = {side: tmp_path / side for side in ("tr", "te")}
    for side, ds in (("tr", train), ("te", test)):
        fm = GradientStorageManager(str(dirs[side]))
        for c, st in enumerate(states):
            model.load_state_dict(st)
            hm = HookManager(model, MASK, callbacks=[OffloadCallback(file_manager=fm)])
            hm.checkpoint = c
            with hm.collect():
                ids = torch.stack([x["input_ids"] for x in ds])
                model.zero_grad()
                loss_fn(model, {"input_ids": ids}).backward()
            hm.remove()
        fm.close()
    cached = ProjectedFisherAttributor(
        run_args(tmp_path), normalized_grad=True, second_moment=moments
    )
    got = cached.attribute_from_cache(dirs["tr"], dirs["te"], damping=lam).query(train, test)
    assert rel(got, ref) < 1e-10
    top = TracInAttributor(run_args(tmp_path), second_moment=moments).attribute_from_cache(
        dirs["tr"], dirs["te"], top_k=2
    )
    best = want.argsort(0, descending=True)[:2].T  # (M, 2) train positions
    expected = [{hash_sample(train[i]) for i in idx.tolist()} for idx in best]
    assert [set(h) for h in top.top_k(2).proponent_hashes] == expected


# ---- non_kronecker="diagonal": the diagonal Fisher of the corrected gradients ------------------
def test_diagonal_layers_get_the_corrected_diagonal_fisher(tmp_path, run):
    model, opt, _, _, d = run
    every = HookManagerConfig()  # emb and norm too: not Kronecker, preconditioned diagonally
    hm = HookManager(model, every)
    sm = SecondMoment.from_optimizer(opt, hm, eps=EPS)
    hm.remove()
    train, test = dataset(8, 1), dataset(3, 2)
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    oracle = Oracle(model, train, test)
    st = {k: opt.state[p]["exp_avg_sq"] for k, p in model.named_parameters()}
    flat = {  # the captured layout: the embedding row-major, the norm [weight | bias]
        "emb": (["emb.weight"], st["emb.weight"].reshape(-1)),
        "norm": (["norm.weight", "norm.bias"], torch.cat([st["norm.weight"], st["norm.bias"]])),
    }
    ref = 0
    for name, (a, g, tr, te, _) in oracle.layers.items():
        q = torch.kron(torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1])
        tr, te = tr * d[name], te * d[name]
        fisher = q @ torch.diag(((tr @ q) ** 2).mean(0)) @ q.T
        ref = ref + tr @ inv(fisher, LAM) @ te.T
    for params, v in flat.values():
        dd = 1.0 / (v + EPS).sqrt()
        tr = torch.cat([ps[k].reshape(len(train), -1) for k in params], 1) * dd
        te = torch.cat([pt[k].reshape(len(test), -1) for k in params], 1) * dd
        ref = ref + (tr / ((tr**2).mean(0) + LAM)) @ te.T
    tr_dir = offload(model, train, tmp_path / "tr", config=every)
    te_dir = offload(model, test, tmp_path / "te", config=every)
    att = EKFACAttributor(run_args(tmp_path), non_kronecker="diagonal", second_moment=sm)
    got = att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test)
    assert sorted(att.factors[0].diagonal) == ["emb", "norm"]
    assert rel(got, ref) < 1e-8


# ---- mix: the fit on corrected train and query gradients ------------------------------------
def test_mix_with_second_moment_mixes_corrected_means(tmp_path, run):
    """EK-FAC: basis of the mixed *uncorrected* A, G; Λ = (1 − m) Λ̃_train + m Λ̃_query."""
    model, opt, _, sm, d = run
    train, test = dataset(8, 1), dataset(3, 2)
    mix = 0.3
    ps, pt = vmap_grads(model, train), vmap_grads(model, test)
    mask_tr = [torch.arange(T) < T - 1] * len(train)
    mask_te = [torch.arange(T) < T - 1] * len(test)
    rows_tr = [{"input_ids": x["input_ids"][None]} for x in train]
    rows_te = [{"input_ids": x["input_ids"][None]} for x in test]
    ref = 0
    for name, bias in LAYERS.items():
        mod = getattr(model, name)
        a_tr, g_tr = kfac_ag(io_oracle(model, loss_fn, rows_tr, mod), token_mask=mask_tr)
        a_te, g_te = kfac_ag(io_oracle(model, loss_fn, rows_te, mod), token_mask=mask_te)
        a, g = (1 - mix) * a_tr + mix * a_te, (1 - mix) * g_tr + mix * g_te
        q = torch.kron(torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1])
        tr = matrix_form(ps, f"{name}.weight", bias) * d[name]
        te = matrix_form(pt, f"{name}.weight", bias) * d[name]
        ev = (1 - mix) * ((tr @ q) ** 2).mean(0) + mix * ((te @ q) ** 2).mean(0)
        ref = ref + tr @ inv(q @ torch.diag(ev) @ q.T, LAM) @ te.T
    tr_dir, te_dir = offload(model, train, tmp_path / "tr"), offload(model, test, tmp_path / "te")
    att = EKFACAttributor(run_args(tmp_path), mix=mix, second_moment=sm)
    got = att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test)
    assert rel(got, ref) < 1e-8
    # non-vacuous: the corrected fit without the queries' share
    alone = EKFACAttributor(run_args(tmp_path), second_moment=sm)
    assert (
        rel(alone.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test), ref) > 1e-3
    )
    # a mask store (vector layers, K-FAC allowed): F̃ = (1 − m) F̃_train + m F̃_query exactly
    hm = HookManager(model, MASK)
    sm_mask = SecondMoment.from_optimizer(opt, hm, eps=EPS)
    hm.remove()
    tr_rec, te_rec = capture(model, train, MASK)[0].gradient, capture(model, test, MASK)[0].gradient
    ref = 0
    for name in LAYERS:
        dd = 1.0 / (sm_mask.v[name] + EPS).sqrt()
        tr = tr_rec.layers[name].materialize().data * dd
        te = te_rec.layers[name].materialize().data * dd
        fisher = (1 - mix) * exact_fisher(name, tr) + mix * exact_fisher(name, te)
        ref = ref + tr @ inv(fisher, LAM) @ te.T
    tr_dir = offload(model, train, tmp_path / "mtr", config=MASK)
    te_dir = offload(model, test, tmp_path / "mte", config=MASK)
    att = KFACAttributor(run_args(tmp_path), mix=mix, second_moment=sm_mask)
    assert (
        rel(att.attribute_from_cache(tr_dir, te_dir, damping=LAM).query(train, test), ref) < 1e-10
    )
