"""Projected captures end to end: capture -> store -> disk source -> TracIn, against live and
against the explicit projection (float64 matrices from the public helpers) of torch.func
per-sample gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    DiskGradientSource,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient import Factorized, Materialized
from dattri_llm.gradient.ops import ProjectionConfig
from dattri_llm.gradient.ops.projection import mask_indices, projection_matrix
from tests.helpers.projection_lm import LM, T, V, loss_fn
from tests.helpers.reference import per_sample_grads, rel_err

pytest.importorskip("dattri")  # logra / dense matrices are dattri's projectors

LAYERS = ("emb", "fc", "ln", "head")


def make_model() -> LM:
    torch.manual_seed(0)
    return LM().double().eval()


def dataset(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (T,), generator=g)} for _ in range(n)]


# logra keeps the norm exact (None) -- logra on a norm is an error; dense / mask cover every layer
PROJECTIONS = {
    "logra": {"ln": None, ".*": ProjectionConfig("logra", proj_dim_in=3, proj_dim_out=4, seed=11)},
    "dense": ProjectionConfig("dense", proj_dim=24, seed=5, proj_type="rademacher"),
    "mask": ProjectionConfig("mask", proj_dim=24, seed=7),
}


def layer_config(projection, name: str) -> ProjectionConfig | None:
    if isinstance(projection, ProjectionConfig):
        return projection
    return projection.get(name, projection[".*"])


def explicit_features(model: nn.Module, ds: list[dict], projection) -> torch.Tensor:
    """``(N, F)``: the explicit projection of each layer's torch.func per-sample matrix form."""
    batch = {"input_ids": torch.stack([d["input_ids"] for d in ds])}
    ref = per_sample_grads(model, loss_fn, batch)

    def wb(name: str) -> torch.Tensor:  # (B, K, D): weight with the bias as a last column
        return torch.cat([ref[f"{name}.weight"], ref[f"{name}.bias"][..., None]], -1)

    forms = {
        "emb": ref["emb.weight"],  # (B, V, E)
        "fc": wb("fc"),
        "ln": torch.stack([ref["ln.weight"], ref["ln.bias"]], 1),  # (B, 2, 7)
        "head": wb("head"),
    }
    out = []
    for name in LAYERS:
        m, cfg = forms[name], layer_config(projection, name)
        b, k, d = m.shape
        if cfg is None:
            out.append(m.reshape(b, -1))
        elif cfg.style == "logra":
            o, p = cfg.projector_options, cfg.proj_type
            row = projection_matrix(k, o["proj_dim_out"], cfg.seed + 1, p, torch.float64)
            col = projection_matrix(d, o["proj_dim_in"], cfg.seed, p, torch.float64)
            out.append((row.T @ m @ col).reshape(b, -1))
        elif cfg.style == "dense":
            p = projection_matrix(k * d, cfg.proj_dim, cfg.seed, cfg.proj_type, torch.float64)
            out.append(m.reshape(b, -1) @ p)
        else:
            out.append(m.reshape(b, -1)[:, mask_indices(k * d, cfg.proj_dim, cfg.seed)])
    return torch.cat(out, 1)


def offload(
    model: nn.Module, ds: list[dict], path, projection, batch: int = 3, keep: bool = False
) -> str:
    """Capture ``ds`` with a projected HookManager and an OffloadCallback (a plain loop).

    ``keep``: ``keep_token_factors`` (token granularity needs the train store's token axis).
    """
    fm = GradientStorageManager(str(path))
    off = OffloadCallback(file_manager=fm, recording_type="per_sample", keep_token_factors=keep)
    hm = HookManager(model, HookManagerConfig(projection=projection), callbacks=[off])
    with hm.collect():
        for i in range(0, len(ds), batch):
            model.zero_grad(set_to_none=True)
            ids = torch.stack([d["input_ids"] for d in ds[i : i + batch]])
            loss_fn(model, {"input_ids": ids}).backward()
    hm.remove()
    model.zero_grad(set_to_none=True)
    fm.close()
    return str(path)


def args(tmp_path, **kw) -> AttributionArguments:
    kw.setdefault("per_device_train_batch_size", 3)
    kw.setdefault("per_device_eval_batch_size", 2)
    return AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False, **kw
    )


@pytest.mark.parametrize("style", ["logra", "dense", "mask"])
def test_projected_store_to_tracin_equals_live_and_explicit(tmp_path, style: str):
    model = make_model()
    projection = PROJECTIONS[style]
    train, test = dataset(7, seed=1), dataset(4, seed=2)
    tr_dir = offload(model, train, tmp_path / "train", projection)
    te_dir = offload(model, test, tmp_path / "test", projection, batch=2)
    f_train = explicit_features(model, train, projection)
    f_test = explicit_features(model, test, projection)
    ref = f_train @ f_test.T

    # the store holds the projected layers unchanged: same types, exact rows, float64
    blocks = list(DiskGradientSource(tr_dir))
    assert [b.gradient.batch_size for b in blocks] == [3, 3, 1]
    stored = torch.cat(
        [torch.cat([b.gradient.layers[n].materialize().data for n in LAYERS], 1) for b in blocks]
    )
    assert stored.dtype == torch.float64 and rel_err(stored, f_train) < 1e-12
    for name in LAYERS:
        lg, cfg = blocks[0].gradient.layers[name], layer_config(projection, name)
        if cfg is None:
            assert not lg.layer_type.startswith("projected.")
        else:
            assert lg.layer_type == f"projected.{cfg.style}"
            # compact storage keeps a logra layer in its smaller exact form
            # (tests/gradient/store/test_compact.py); the vector styles are always dense
            kinds = (Factorized, Materialized) if cfg.style == "logra" else Materialized
            assert isinstance(lg, kinds)

    task = AttributionTask(loss_fn, model)
    hook_config = HookManagerConfig(projection=projection)
    live = TracInAttributor(args(tmp_path), task=task).attribute(
        train, test, hook_config=hook_config
    )
    assert rel_err(live.query(train, test), ref) < 1e-10
    for mode in ("auto", "factorized", "materialized"):
        att = TracInAttributor(args(tmp_path, score_block_size=2), mode=mode)
        cached = att.attribute_from_cache(tr_dir, te_dir)
        assert rel_err(cached.query(train, test), ref) < 1e-10, mode
        assert rel_err(cached.query(train, test), live.query(train, test)) < 1e-10, mode
    assert cached.train_steps == [0, 0, 0, 1, 1, 1, 2]

    # Grad-Cos on the projected features: normalised by the projected norms
    cos = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(
        tr_dir, te_dir
    )
    n_tr, n_te = f_train.norm(dim=1, keepdim=True), f_test.norm(dim=1, keepdim=True)
    assert rel_err(cos.query(train, test), (f_train / n_tr) @ (f_test / n_te).T) < 1e-10

    # a projection is not the identity: unprojected scores differ
    exact = explicit_features(model, train, {".*": None})
    assert rel_err(ref, exact @ explicit_features(model, test, {".*": None}).T) > 1e-3


def test_logra_token_granularity_sums_to_instance_scores(tmp_path):
    model = make_model()
    projection = PROJECTIONS["logra"]
    train, test = dataset(5, seed=3), dataset(3, seed=4)
    tr_dir = offload(model, train, tmp_path / "train", projection, batch=2, keep=True)
    te_dir = offload(model, test, tmp_path / "test", projection)
    ref = explicit_features(model, train, projection) @ explicit_features(model, test, projection).T
    task = AttributionTask(loss_fn, model)
    live = TracInAttributor(args(tmp_path), task=task).attribute(
        train,
        test,
        hook_config=HookManagerConfig(projection=projection),
        attribution_granularity="token",
    )
    scores = {"live": live}
    for mode in ("auto", "factorized", "materialized"):
        scores[mode] = TracInAttributor(args(tmp_path), mode=mode).attribute_from_cache(
            tr_dir, te_dir, attribution_granularity="token"
        )
    for how, score in scores.items():
        assert score.has_token_scores
        assert rel_err(score.query(train, test), ref) < 1e-10, how
        for item in train:
            pos, ts = score.token_scores(item)
            assert pos.tolist() == list(range(T)) and ts.shape == (T, len(test))
            assert rel_err(ts.sum(0), score.query([item], test)[0]) < 1e-10, how
            # the last position predicts nothing (its logits are not in the loss)
            assert torch.all(ts[-1] == 0) and ts[:-1].abs().sum() > 0
        if how != "live":
            for item in train:
                assert rel_err(score.token_scores(item)[1], live.token_scores(item)[1]) < 1e-10

    # dense / mask layers are vectors without a token axis: a clear error
    dense_dir = offload(model, train, tmp_path / "dense", PROJECTIONS["dense"])
    dense_test = offload(model, test, tmp_path / "dense_test", PROJECTIONS["dense"])
    with pytest.raises(ValueError, match="Capture factorized"):
        TracInAttributor(args(tmp_path)).attribute_from_cache(
            dense_dir, dense_test, attribution_granularity="token"
        )
