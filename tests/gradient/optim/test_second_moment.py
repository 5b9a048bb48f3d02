"""TrackStar's correction at capture (``precondition="second_moment"``) vs formulas written out.

Reference: per-sample gradients by ``torch.func`` (``vmap(grad)``), laid out in the matrix form
by hand (``tests/helpers/trajectory.py``), times ``1/√(v + ε)`` with ``v`` read from
``opt.state[p]["exp_avg_sq"]`` directly and ``ε = 1e-8``; the mask's coordinates and the dense
projection matrix from the projection's seeded generators. Model: Embedding + LayerNorm +
Linear + an LM head tied to the embedding, float64, AdamW warm-started by real steps.
Tolerance: ``1e-10`` relative (``1e-9`` on scores after a Fisher inverse).
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    LESSAttributor,
    OffloadCallback,
    ProjectedFisherAttributor,
    ProjectionConfig,
    TracInAttributor,
)
from dattri_llm.attribution.normalization import SecondMoment
from dattri_llm.gradient.ops.projection import mask_indices, projection_matrix
from dattri_llm.gradient.optim.second_moment import DEFAULT_EPS
from dattri_llm.gradient.sources import DiskGradientSource
from dattri_llm.gradient.streaming import GradientStreamer
from tests.helpers.precondition import LAYERS, capture, raw_then_mapped, warm_started
from tests.helpers.trajectory import (
    DT,
    layer_rows,
    lm_batch,
    lm_loss_row,
    lm_sample_losses,
    param_rows,
    per_sample_grads,
    rel_err,
)

SM = {"precondition": "second_moment"}
MASK = ProjectionConfig("mask", proj_dim=10, seed=3)
DENSE = ProjectionConfig("dense", proj_dim=8, seed=5)


def explicit(model, opt, batch, scale: float = 1.0):
    """``{layer: (B, P)}`` raw rows and ``{layer: (P,)}`` scales ``1/√(v + ε)``, by hand."""
    grads = per_sample_grads(model, lm_loss_row, batch)
    raw = {k: v * scale for k, v in layer_rows(model, grads, LAYERS).items()}
    state = {n: opt.state[p]["exp_avg_sq"] for n, p in model.named_parameters()}
    v = param_rows(model, state, LAYERS)
    return raw, {k: 1.0 / (x + 1e-8).sqrt() for k, x in v.items()}


def rows(rec, layer):
    return rec.gradient.layers[layer].materialize().data


# ---- (a) the map itself --------------------------------------------------------------------------
def test_corrected_capture_is_the_raw_gradient_over_root_v_plus_eps():
    assert DEFAULT_EPS == 1e-8 and SecondMoment({"x": torch.ones(1)}).eps == DEFAULT_EPS
    model, opt = warm_started("adamw_param_groups")
    batch = lm_batch(3, seed=7)
    rec = capture(model, opt, batch, **SM)
    raw, d = explicit(model, opt, batch)
    assert rec.gradient.layer_names == LAYERS  # "head" is tied to "emb": one layer
    for layer in LAYERS:
        got = rows(rec, layer)
        assert got.dtype == DT
        assert rel_err(got, raw[layer] * d[layer]) <= 1e-10, layer
        # non-vacuous: the scales are far from one and from a constant
        assert rel_err(raw[layer] * d[layer], raw[layer] * d[layer].mean()) > 1e-2, layer
    # the metadata: kind, eps and SecondMoment's own fingerprint of the same v
    hm = HookManager(model)
    fp = SecondMoment.from_optimizer(opt, hm).fingerprint()
    hm.remove()
    meta = rec.metadata["preconditioned"]
    assert meta["kind"] == "second_moment" and meta["eps"] == 1e-8
    assert meta["second_moment"] == fp and meta["optimizer"] == "AdamW"
    assert meta["updates"] == 3 and "learning_rate" not in rec.metadata


def test_mask_and_dense_after_the_correction_equal_projecting_the_corrected_rows():
    model, opt = warm_started("adamw_amsgrad")
    batch = lm_batch(3, seed=8)
    raw, d = explicit(model, opt, batch)
    fixed = {k: raw[k] * d[k] for k in LAYERS}
    # tied emb / head masked, fc dense, norm exact
    config = HookManagerConfig(projection={"emb|head": MASK, "fc": DENSE})
    rec = capture(model, opt, batch, config=config, **SM)
    idx = mask_indices(fixed["emb"].shape[1], 10, 3)
    assert rel_err(rows(rec, "emb"), fixed["emb"][:, idx]) <= 1e-10
    mat = projection_matrix(fixed["fc"].shape[1], 8, 5, dtype=DT)
    assert rows(rec, "fc").shape == (3, 8)
    assert rel_err(rows(rec, "fc"), fixed["fc"] @ mat) <= 1e-10
    assert rel_err(rows(rec, "norm"), fixed["norm"]) <= 1e-10
    # every layer dense: the dense projection (same seed) of the corrected raw gradient
    rec = capture(model, opt, batch, config=HookManagerConfig(projection=DENSE), **SM)
    for layer in LAYERS:
        mat = projection_matrix(fixed[layer].shape[1], 8, 5, dtype=DT)
        assert rel_err(rows(rec, layer), fixed[layer] @ mat) <= 1e-10, layer
        # non-vacuous: correcting after the projection is another thing
        assert rel_err(rows(rec, layer), raw[layer] @ mat * d[layer].mean()) > 1e-2
    # the fingerprint is that of the full coordinates (the correction precedes the projection)
    hm = HookManager(model)
    assert rec.metadata["preconditioned"]["second_moment"] == (
        SecondMoment.from_optimizer(opt, hm).fingerprint()
    )
    hm.remove()


def test_scale_first_step_and_raw_pass():
    batch = lm_batch(4, seed=9)
    model, opt = warm_started("adamw_first_step")  # no state yet: v = 0, scale 1/√ε = 1e4
    raw = layer_rows(model, per_sample_grads(model, lm_loss_row, batch), LAYERS)
    rec = capture(model, opt, batch, reduction="mean", precondition_scale="batch_size", **SM)
    for layer in LAYERS:
        assert rel_err(rows(rec, layer), raw[layer] * 1e4) <= 1e-10
    assert rec.metadata["preconditioned"]["scale"] == "batch_size"
    # a number scales the share; HookManager.raw_gradients() turns the correction off
    model, opt = warm_started("adam_coupled_wd")
    raw, d = explicit(model, opt, batch)
    plain, fixed = raw_then_mapped(model, opt, batch, precondition_scale=2.0, **SM)
    assert "preconditioned" not in plain.metadata
    for layer in LAYERS:
        assert rel_err(rows(plain, layer), raw[layer]) <= 1e-10
        assert rel_err(rows(fixed, layer), 2.0 * raw[layer] * d[layer]) <= 1e-10


# ---- refusals at construction -------------------------------------------------------------------
def test_sgd_other_spellings_and_logra_refused():
    model, sgd = warm_started("sgd_momentum_dampening_wd")
    with pytest.raises(ValueError, match="SGD.*no second moment.*Adam / AdamW"):
        HookManager(model, optimizer=sgd, **SM)
    with pytest.raises(ValueError, match="precondition=.*second_moment.*got 'adam'"):
        HookManager(model, optimizer=sgd, precondition="adam")
    with pytest.raises(ValueError, match="needs optimizer="):
        HookManager(model, **SM)
    model, opt = warm_started("adamw_first_step")
    logra = HookManagerConfig(projection={"fc": ProjectionConfig("logra", proj_dim=4)})
    with pytest.raises(ValueError, match="logra"):
        HookManager(model, config=logra, optimizer=opt, **SM)
    # a parameter outside the optimizer: refused at the step, naming it
    part = torch.optim.AdamW([model.fc.weight, model.fc.bias], lr=0.01)
    with pytest.raises(ValueError, match="not updated by the optimizer.*exclude the layer"):
        capture(model, part, lm_batch(2, seed=1), **SM)
    # precondition=True still means LESS's Adam direction (no "kind")
    rec = capture(model, opt, lm_batch(2, seed=1))
    assert "kind" not in rec.metadata["preconditioned"]


# ---- stores and scores ---------------------------------------------------------------------------
def samples(n: int, seed: int) -> list[dict]:
    ids = lm_batch(n, seed=seed)["input_ids"]
    return [{"input_ids": r} for r in ids]


def offload(model, opt, ds, path, config=None, steps=(), checkpoint=0, **hm_kw) -> str:
    """Capture ``ds`` in batches of 3 into a store (appended to, labelled ``checkpoint``);
    ``steps``: batch indices after which the optimizer takes a real step (the correction's
    ``v`` then changes within the store)."""
    fm = GradientStorageManager(str(path), mode="append")
    hm = HookManager(
        model, config, callbacks=[OffloadCallback(file_manager=fm)], optimizer=opt, **hm_kw
    )
    hm.checkpoint = checkpoint
    with hm.collect():
        for k, i in enumerate(range(0, len(ds), 3)):
            ids = torch.stack([d["input_ids"] for d in ds[i : i + 3]])
            model.zero_grad()
            lm_sample_losses(model(input_ids=ids), ids).sum().backward()
            if k in steps:
                with hm.paused():
                    opt.step()
    hm.remove()
    fm.close()
    return str(path)


def args(tmp_path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


@pytest.fixture
def corrected(tmp_path):
    model, opt = warm_started("adamw_param_groups")
    train, test = samples(7, 21), samples(3, 22)
    raw_tr = offload(model, None, train, tmp_path / "raw_tr")
    raw_te = offload(model, None, test, tmp_path / "raw_te")
    tr = offload(model, opt, train, tmp_path / "tr", **SM)
    te = offload(model, opt, test, tmp_path / "te", **SM)
    hm = HookManager(model)
    sm = SecondMoment.from_optimizer(opt, hm)
    hm.remove()
    return model, opt, train, test, (raw_tr, raw_te, tr, te), sm


def _fixed(model, opt, ds):
    batch = {"input_ids": torch.stack([d["input_ids"] for d in ds])}
    raw, d = explicit(model, opt, batch)
    return {k: raw[k] * d[k] for k in LAYERS}


def test_grad_cos_and_projected_fisher_on_a_corrected_capture_equal_second_moment(
    tmp_path, corrected
):
    model, opt, train, test, (raw_tr, raw_te, tr, te), sm = corrected
    g, q = _fixed(model, opt, train), _fixed(model, opt, test)
    gc = torch.cat([g[k] for k in LAYERS], 1)
    qc = torch.cat([q[k] for k in LAYERS], 1)
    cos = (gc / gc.norm(dim=1, keepdim=True)) @ (qc / qc.norm(dim=1, keepdim=True)).T
    on_capture = TracInAttributor(args(tmp_path), normalized_grad=True)
    got = on_capture.attribute_from_cache(tr, te).query(train, test)
    at_scoring = TracInAttributor(args(tmp_path), normalized_grad=True, second_moment=sm)
    want = at_scoring.attribute_from_cache(raw_tr, raw_te).query(train, test)
    assert rel_err(got, want) <= 1e-10 and rel_err(got, cos) <= 1e-10
    raw_cos = TracInAttributor(args(tmp_path), normalized_grad=True)
    assert rel_err(raw_cos.attribute_from_cache(raw_tr, raw_te).query(train, test), cos) > 1e-2
    # ProjectedFisher: q̃ᵀ (F̃ + λI)⁻¹ g̃ per layer, F̃ the Fisher of the corrected train rows,
    # λ the default: 0.1 × F̃'s mean eigenvalue
    ref = 0
    for k in LAYERS:
        f = g[k].T @ g[k] / len(g[k])
        lam = 0.1 * float(torch.trace(f)) / len(f)
        ref = ref + g[k] @ torch.linalg.inv(f + lam * torch.eye(len(f), dtype=DT)) @ q[k].T
    got = ProjectedFisherAttributor(args(tmp_path)).attribute_from_cache(tr, te)
    want = ProjectedFisherAttributor(args(tmp_path), second_moment=sm).attribute_from_cache(
        raw_tr, raw_te
    )
    got, want = got.query(train, test), want.query(train, test)
    assert rel_err(got, want) <= 1e-10 and rel_err(got, ref) <= 1e-9


def test_dense_corrected_store_scores_are_the_cosines_of_projected_corrected_rows(tmp_path):
    model, opt = warm_started("adamw_amsgrad")
    train, test = samples(6, 31), samples(2, 32)
    cfg = HookManagerConfig(projection=DENSE)
    tr = offload(model, opt, train, tmp_path / "tr", config=cfg, **SM)
    te = offload(model, opt, test, tmp_path / "te", config=cfg, **SM)
    g, q = _fixed(model, opt, train), _fixed(model, opt, test)
    mats = {k: projection_matrix(g[k].shape[1], 8, 5, dtype=DT) for k in LAYERS}
    gc = torch.cat([g[k] @ mats[k] for k in LAYERS], 1)
    qc = torch.cat([q[k] @ mats[k] for k in LAYERS], 1)
    cos = (gc / gc.norm(dim=1, keepdim=True)) @ (qc / qc.norm(dim=1, keepdim=True)).T
    got = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(tr, te)
    assert rel_err(got.query(train, test), cos) <= 1e-10
    # SecondMoment on this projected store names the capture-time route
    with pytest.raises(ValueError, match='precondition="second_moment"'):
        hm = HookManager(model)
        sm = SecondMoment.from_optimizer(opt, hm)
        hm.remove()
        raw_tr = offload(model, None, train, tmp_path / "raw_tr", config=cfg)
        raw_te = offload(model, None, test, tmp_path / "raw_te", config=cfg)
        TracInAttributor(args(tmp_path), second_moment=sm).attribute_from_cache(raw_tr, raw_te)


# ---- train / query consistency -------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:the train gradients of checkpoint 0")
def test_mismatched_corrections_are_refused_naming_both_sides(tmp_path, corrected):
    model, opt, train, test, (raw_tr, raw_te, tr, te), sm = corrected
    att = TracInAttributor(args(tmp_path), normalized_grad=True)
    for a, b in ((tr, raw_te), (raw_tr, te)):
        with pytest.raises(ValueError, match="must be the same on both sides") as e:
            att.attribute_from_cache(a, b)
        assert a in str(e.value) and b in str(e.value)
        assert "not corrected at capture" in str(e.value)
        assert 'precondition="second_moment"' in str(e.value)
    # differently corrected: the optimizer took a step between the two captures
    model.zero_grad()
    b = lm_batch(3, seed=5)
    lm_sample_losses(model(**b), b["input_ids"]).sum().backward()
    opt.step()
    te2 = offload(model, opt, test, tmp_path / "te2", **SM)
    with pytest.raises(ValueError, match="must be the same on both sides"):
        att.attribute_from_cache(tr, te2)
    # a store whose later records carry another correction: refused at that block
    mixed = offload(model, opt, train, tmp_path / "mixed", steps=(0,), **SM)
    with pytest.raises(ValueError, match="at step 1 .*must be the same"):
        att.attribute_from_cache(mixed, te2)
    with pytest.raises(ValueError, match="first block.*those of step 1 .*must be the same"):
        att.attribute_from_cache(te2, mixed)  # as the test side
    # a second correction at scoring time is refused
    with pytest.raises(ValueError, match="already corrected at capture"):
        TracInAttributor(args(tmp_path), second_moment=sm).attribute_from_cache(tr, te)
    with pytest.raises(ValueError, match="already corrected at capture"):
        ProjectedFisherAttributor(args(tmp_path), second_moment=sm).attribute_from_cache(tr, te)


def test_live_query_sources_get_the_same_correction_or_are_refused(tmp_path, corrected):
    model, opt, train, test, (raw_tr, raw_te, tr, te), sm = corrected

    def loss(m, batch):
        return lm_sample_losses(m(input_ids=batch["input_ids"]), batch["input_ids"]).sum()

    att = TracInAttributor(args(tmp_path), normalized_grad=True)
    want = att.attribute_from_cache(tr, te).query(train, test)
    live = GradientStreamer(model, test, loss, batch_size=2, optimizer=opt, **SM)
    got = att.attribute_sources(DiskGradientSource(tr), live).query(train, test)
    assert rel_err(got, want) <= 1e-10
    raw_live = GradientStreamer(model, test, loss, batch_size=2)
    with pytest.raises(ValueError, match="not corrected at capture"):
        att.attribute_sources(DiskGradientSource(tr), raw_live)
    # LESS: a corrected store is not Adam's update direction; its own convention is unchanged
    with pytest.raises(ValueError, match="corrected by TrackStar's.*precondition=True"):
        LESSAttributor(args(tmp_path)).attribute_from_cache(tr, raw_te, learning_rates=1.0)


def test_gradient_index_over_a_dense_corrected_store(tmp_path):
    """TrackStar at corpus scale: a cosine index over the corrected dense store; raw queries
    are refused, corrected ones give the cosines of the projected corrected rows."""
    from dattri_llm import GradientIndex

    model, opt = warm_started("adamw_amsgrad")
    train, test = samples(6, 41), samples(2, 42)
    cfg = HookManagerConfig(projection=DENSE)
    tr = offload(model, opt, train, tmp_path / "tr", config=cfg, **SM)
    te = offload(model, opt, test, tmp_path / "te", config=cfg, **SM)
    raw_te = offload(model, None, test, tmp_path / "raw_te", config=cfg)
    GradientIndex.build(tr, tmp_path / "idx", metric="cosine", kind="flat")
    index = GradientIndex.open(tmp_path / "idx")
    with pytest.raises(ValueError, match="must be the same on both sides"):
        index.search(raw_te, k=3)
    want = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(tr, te)
    got = index.search(te, k=6)
    assert rel_err(got.query(train, test), want.query(train, test)) <= 1e-6  # float32 FAISS


def test_per_checkpoint_corrections_equal_one_second_moment_per_checkpoint(tmp_path):
    """TrackStar over checkpoints: each checkpoint's capture corrected with its own ``v``,
    paired with queries corrected alike, equals ``second_moment=[v_0, v_1]`` on raw stores and
    the written-out sum of per-checkpoint cosines."""
    model, opt = warm_started("adamw_param_groups")
    train, test = samples(6, 51), samples(2, 52)
    dirs = {k: str(tmp_path / k) for k in ("tr", "te", "raw_tr", "raw_te")}
    moments, want = [], 0
    for c in (0, 1):
        if c:  # a real step: new weights and a new second moment
            b = lm_batch(3, seed=53)
            model.zero_grad()
            lm_sample_losses(model(**b), b["input_ids"]).sum().backward()
            opt.step()
        offload(model, opt, train, dirs["tr"], checkpoint=c, **SM)
        offload(model, opt, test, dirs["te"], checkpoint=c, **SM)
        offload(model, None, train, dirs["raw_tr"], checkpoint=c)
        offload(model, None, test, dirs["raw_te"], checkpoint=c)
        hm = HookManager(model)
        moments.append(SecondMoment.from_optimizer(opt, hm))
        hm.remove()
        g, q = _fixed(model, opt, train), _fixed(model, opt, test)
        gc = torch.cat([g[k] for k in LAYERS], 1)
        qc = torch.cat([q[k] for k in LAYERS], 1)
        want = want + (gc / gc.norm(dim=1, keepdim=True)) @ (qc / qc.norm(dim=1, keepdim=True)).T
    got = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(
        dirs["tr"], dirs["te"]
    )
    ref = TracInAttributor(args(tmp_path), normalized_grad=True, second_moment=moments)
    ref = ref.attribute_from_cache(dirs["raw_tr"], dirs["raw_te"])
    got, ref = got.query(train, test), ref.query(train, test)
    assert rel_err(got, ref) <= 1e-10 and rel_err(got, want) <= 1e-10
    # non-vacuous: the two checkpoints' corrections differ (one v for both would be wrong)
    one = TracInAttributor(args(tmp_path), normalized_grad=True, second_moment=moments[0])
    assert (
        rel_err(one.attribute_from_cache(dirs["raw_tr"], dirs["raw_te"]).query(train, test), want)
        > 1e-6
    )
    # queries captured once, at the last state: they pair with every train checkpoint, and
    # checkpoint 0's train blocks (another v) are refused
    last = offload(model, opt, test, tmp_path / "te_last", **SM)
    with pytest.raises(ValueError, match="must be the same on both sides"):
        TracInAttributor(args(tmp_path)).attribute_from_cache(dirs["tr"], last)
