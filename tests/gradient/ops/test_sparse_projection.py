"""The ``"sparse"`` projection: every path equals the explicit ``(K*D, m)``
matrix built here, entry by entry, from the documented hashes; inner products are unbiased over
seeds; seeds and ``nnz`` are recorded and checked between train and test; capture -> store ->
TracIn equals the oracle projection of torch.func per-sample gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient import Materialized, ops
from dattri_llm.gradient.compat import IncompatibleGradientsError
from dattri_llm.gradient.layers.base import OuterProductRule
from dattri_llm.gradient.layers.embedding import EmbeddingRule
from dattri_llm.gradient.ops import ProjectionConfig, sparse_projection
from dattri_llm.gradient.ops.projection import (
    clear_projection_cache,
    layer_projection,
    project_gradient,
    projection_cache_info,
)
from dattri_llm.gradient.ops.sparse_projection import sketch_dense, sketch_factors, sparse_hashes
from tests.helpers.projection import capture, loss_fn, make_batch, matrix_forms, net
from tests.helpers.projection_lm import LM, T, V  # the tiny LM of the end-to-end tests
from tests.helpers.projection_lm import loss_fn as lm_loss
from tests.helpers.reference import per_sample_grads, rel_err


def oracle_matrix(k: int, d: int, m: int, seed: int, nnz: int) -> torch.Tensor:
    """The explicit ``(K*D, m)`` float64 matrix: entry ``(i, j)`` goes to ``h_r(i) + c_r(j)``."""
    h = sparse_hashes(k, d, m, seed, nnz)
    p = torch.zeros(k * d, m, dtype=torch.float64)
    for r in range(nnz):
        for i in range(k):
            for j in range(d):
                bucket = (int(h["row"][r, i]) + int(h["col"][r, j])) % m
                sign = float(h["row_sign"][r, i]) * float(h["col_sign"][r, j])
                p[i * d + j, bucket] += sign / math.sqrt(nnz)
    return p


def oracle(cfg: ProjectionConfig, m: torch.Tensor) -> torch.Tensor:
    b, k, d = m.shape
    nnz = cfg.projector_options["nnz"]
    return m.reshape(b, -1) @ oracle_matrix(k, d, cfg.proj_dim, cfg.seed, nnz)


@pytest.mark.parametrize("nnz", [1, 3])
def test_sketches_equal_the_explicit_matrix(nnz: int):
    torch.manual_seed(0)
    b, t, k, d, m = 3, 5, 7, 4, 11
    g = torch.randn(b, t, k, dtype=torch.float64)
    a = torch.randn(b, t, d, dtype=torch.float64)
    mat = torch.einsum("btk,btd->bkd", g, a).reshape(b, -1)
    h = sparse_hashes(k, d, m, seed=2, nnz=nnz, dtype=torch.float64)
    want = mat @ oracle_matrix(k, d, m, 2, nnz)
    assert rel_err(sketch_dense(mat, (k, d), m, h), want) < 1e-12
    assert rel_err(sketch_factors(g, a, m, h), want) < 1e-12  # the factorised (FFT) path
    # embeddings: one-hot rows from indices (repeated indices add up)
    idx = torch.randint(0, k, (b, t))
    onehot = torch.nn.functional.one_hot(idx, k).double()
    emb = torch.einsum("btk,btd->bkd", onehot, a).reshape(b, -1)
    want = emb @ oracle_matrix(k, d, m, 2, nnz)
    assert rel_err(sketch_factors(idx, a, m, h), want) < 1e-12
    # the hashes are stored small: int32 buckets and int8 signs on the CPU
    base = sparse_projection._CACHE[("sparse", k, d, m, 2, nnz)]
    assert base["row"].dtype == torch.int32 and base["row_sign"].dtype == torch.int8
    assert set(base["row_sign"].unique().tolist()) <= {-1, 1}


@pytest.mark.parametrize("factorized", [True, False])
@pytest.mark.parametrize("capture_style", ["factorized", "materialized", "auto"])
def test_capture_equals_oracle_on_every_layer_type(
    monkeypatch: pytest.MonkeyPatch, capture_style: str, factorized: bool
):
    # force the factorised sketch (or the dense path) whatever the cost model says
    monkeypatch.setattr(sparse_projection, "factorized_sketch_cheaper", lambda *a, **k: factorized)
    if factorized and capture_style == "factorized":

        def boom(*args, **kwargs):
            raise AssertionError("the factorised sparse sketch formed a per-sample gradient")

        for cls in (OuterProductRule, EmbeddingRule):
            monkeypatch.setattr(cls, "materialize", boom)
    model = net()
    b1, b2 = make_batch(4), make_batch(3)
    proj = ProjectionConfig("sparse", proj_dim=9, seed=4, nnz=2)
    cfg = HookManagerConfig(projection=proj, capture_style=capture_style)
    g1, g2 = capture(model, b1, cfg), capture(model, b2, cfg)
    monkeypatch.undo()
    m1 = matrix_forms(per_sample_grads(model, loss_fn, b1))
    m2 = matrix_forms(per_sample_grads(model, loss_fn, b2))
    for name, lg in g1.layers.items():
        assert isinstance(lg, Materialized) and lg.layer_type == "projected.sparse"
        assert lg.module_kwargs["nnz"] == 2 and lg.module_kwargs["seed"] == 4
        r1, r2 = oracle(proj, m1[name]), oracle(proj, m2[name])
        assert rel_err(lg.data, r1) < 1e-12, name
        assert rel_err(ops.layer_cross_dot(lg, g2.layers[name]), r1 @ r2.T) < 1e-12, name
    # after the fact: project_gradient of the exact capture gives the same vectors
    exact = capture(model, b1, HookManagerConfig())
    again = project_gradient(exact, proj)
    for name, lg in g1.layers.items():
        assert rel_err(again.layers[name].data, lg.data) < 1e-12, name


def test_factorized_path_equals_dense_path_on_a_wide_layer():
    # a layer wide enough that the cost model picks the factorised sketch by itself
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(96, 80), nn.Tanh(), nn.Linear(80, 3)).double()
    x = torch.randn(5, 4, 96, dtype=torch.float64)
    rule_kw = {"in_features": 96, "out_features": 80, "bias": True, "_k": 80, "_d": 97}
    assert sparse_projection.factorized_sketch_cheaper(4, (80, 97), 16, 1)
    proj = {"0": ProjectionConfig("sparse", proj_dim=16, seed=3), "2": None}
    out = {}
    for style in ("factorized", "materialized"):
        cb = CaptureCallback()
        hm = HookManager(model, HookManagerConfig(projection=proj, capture_style=style), [cb])
        with hm.collect(deregister_on_exit=True):
            model(x).pow(2).sum().backward()
        model.zero_grad(set_to_none=True)
        out[style] = cb.pop().gradient.layers["0"].data
    assert rel_err(out["factorized"], out["materialized"]) < 1e-12
    lp = layer_projection(proj["0"], "nn.Linear", rule_kw)
    assert lp.module_kwargs["proj_dim"] == 16


def _project(style: str, seed: int, mats: torch.Tensor, dim: int) -> torch.Tensor:
    if style == "logra":
        cfg = ProjectionConfig("logra", proj_dim=dim, seed=seed)
    else:
        cfg = ProjectionConfig(style, proj_dim=dim, seed=seed)
    k, d = mats.shape[1:]
    lp = layer_projection(cfg, "nn.Linear", {"in_features": d - 1, "out_features": k, "bias": True})
    if style == "logra":
        m = lp.matrices(torch.float64)
        return (m["row"].T @ mats @ m["col"]).reshape(mats.shape[0], -1)
    return lp.project_item(
        Materialized(mats.reshape(mats.shape[0], -1), "nn.Linear", lp.source_kwargs)
    ).data


@pytest.mark.parametrize("style", ["sparse", "dense", "logra"])
def test_inner_products_are_unbiased_over_seeds(style: str):
    """The JL check: over seeds the mean projected inner product (and squared norm) is the exact
    one, within 4 standard errors; the spread shrinks with the projection size."""
    if style != "sparse":
        pytest.importorskip("dattri")
    torch.manual_seed(0)
    k, d, seeds = 6, 5, 300
    base = torch.randn(3, k, d, dtype=torch.float64)
    mats = torch.stack([base[0], base[0] + 0.5 * base[1], base[2]])  # correlated and not
    exact = mats.reshape(3, -1) @ mats.reshape(3, -1).T
    spread = {}
    for dim in (4, 16):
        est = torch.stack([_project(style, s, mats, dim) for s in range(seeds)])
        grams = est @ est.transpose(1, 2)  # (seeds, 3, 3)
        mean, se = grams.mean(0), grams.std(0) / math.sqrt(seeds)
        assert torch.all((mean - exact).abs() <= 4 * se + 1e-12), (dim, mean, exact)
        spread[dim] = float((grams - exact).pow(2).mean().sqrt())
    assert spread[16] < 0.7 * spread[4]


def test_more_nonzeros_lower_the_structured_variance():
    """For rank-one gradients the TensorSketch terms dominate; nnz copies divide them."""
    torch.manual_seed(0)
    k, d, m, seeds = 12, 10, 16, 500
    x, y = torch.randn(k, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    mat = torch.outer(x, y).reshape(1, -1)
    exact = float(mat.pow(2).sum())
    var = {}
    for nnz in (1, 4):
        sq = []
        for s in range(seeds):
            h = sparse_hashes(k, d, m, s, nnz, torch.float64)
            sq.append(float(sketch_dense(mat, (k, d), m, h).pow(2).sum()))
        est = torch.tensor(sq)
        assert abs(float(est.mean()) - exact) <= 4 * float(est.std()) / math.sqrt(seeds)
        var[nnz] = float(est.var())
    assert var[4] < 0.8 * var[1]  # theory: (2 + 4 / 4) / (2 + 4) = 0.5


def test_bad_options_and_refused_layers_are_clear_errors():
    with pytest.raises(ValueError, match=r"nnz=\) must be an int in \[1, proj_dim=8\]"):
        ProjectionConfig("sparse", proj_dim=8, nnz=0)
    with pytest.raises(ValueError, match="unknown projector options"):
        ProjectionConfig("sparse", proj_dim=8, proj_type="normal")
    cfg = ProjectionConfig("sparse", proj_dim=8, nnz=2)
    assert cfg.to_dict() == {"style": "sparse", "proj_dim": 8, "seed": 0, "nnz": 2}
    assert ProjectionConfig(**cfg.to_dict()) == cfg and not cfg.needs_dattri
    assert ProjectionConfig("sparse", proj_dim=8).projector_options["nnz"] == 1
    model = net()
    with pytest.raises(ValueError, match="param_grad"):
        HookManager(model, HookManagerConfig(param_grad=["fc"], projection=cfg))
    # a projected layer accepts no further projection
    with pytest.raises(ValueError, match=r"does not accept the 'sparse' projection"):
        layer_projection(cfg, "projected.dense", {"_k": 1, "_d": 4})


def test_cached_state_is_tiny():
    clear_projection_cache()
    before = projection_cache_info()["generated"]
    model = net()
    capture(model, make_batch(2), HookManagerConfig(projection=ProjectionConfig("sparse", 64)))
    info = projection_cache_info()
    # six layer shapes: nnz * (K + D) int32 + int8 on the CPU, int64 / float64 working copies
    assert info["generated"] - before == 6 and 0 < info["bytes"] < 5_000


# ---- store -> TracIn -------------------------------------------------------------------------


def offload(model: nn.Module, ids: torch.Tensor, path, projection, batch: int = 3) -> str:
    fm = GradientStorageManager(str(path))
    hm = HookManager(
        model,
        HookManagerConfig(projection=projection),
        callbacks=[OffloadCallback(file_manager=fm, recording_type="per_sample")],
    )
    with hm.collect():
        for i in range(0, len(ids), batch):
            model.zero_grad(set_to_none=True)
            lm_loss(model, {"input_ids": ids[i : i + batch]}).backward()
    hm.remove()
    model.zero_grad(set_to_none=True)
    fm.close()
    return str(path)


def features(model: nn.Module, ids: torch.Tensor, cfg: ProjectionConfig) -> torch.Tensor:
    ref = per_sample_grads(model, lm_loss, {"input_ids": ids})

    def wb(name: str) -> torch.Tensor:
        return torch.cat([ref[f"{name}.weight"], ref[f"{name}.bias"][..., None]], -1)

    forms = [ref["emb.weight"], wb("fc"), torch.stack([ref["ln.weight"], ref["ln.bias"]], 1)]
    return torch.cat([oracle(cfg, m) for m in [*forms, wb("head")]], 1)


def test_store_to_tracin_equals_oracle_and_seed_mismatch_is_refused(tmp_path):
    torch.manual_seed(0)
    model = LM().double().eval()
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, V, (7, T), generator=gen)
    test = torch.randint(0, V, (4, T), generator=gen)
    cfg = ProjectionConfig("sparse", proj_dim=24, seed=5)
    tr_dir = offload(model, train, tmp_path / "train", cfg)
    te_dir = offload(model, test, tmp_path / "test", cfg, batch=2)
    ref = features(model, train, cfg) @ features(model, test, cfg).T
    args = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)
    train_items = [{"input_ids": r} for r in train]
    test_items = [{"input_ids": r} for r in test]
    for mode in ("auto", "factorized", "materialized"):
        score = TracInAttributor(args, mode=mode).attribute_from_cache(tr_dir, te_dir)
        assert rel_err(score.query(train_items, test_items), ref) < 1e-10, mode
    # another seed, or another nnz, is another space: refused with the difference named
    other = offload(model, test, tmp_path / "seed1", ProjectionConfig("sparse", 24, seed=6))
    with pytest.raises(IncompatibleGradientsError, match=r"seed: 5 vs 6"):
        TracInAttributor(args).attribute_from_cache(tr_dir, other)
    nnz2 = offload(model, test, tmp_path / "nnz2", ProjectionConfig("sparse", 24, seed=5, nnz=2))
    with pytest.raises(IncompatibleGradientsError, match=r"nnz: 1 vs 2"):
        TracInAttributor(args).attribute_from_cache(tr_dir, nnz2)
