"""Capture-time random projection: every style equals the explicit projection of the torch.func
per-sample gradients with the very matrices the projection uses (fetched here from the public
matrix functions, seeds as documented: column side ``seed``, row side ``seed + 1``)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Factorized, Gradient, Materialized, Shared, ops
from dattri_llm.gradient.layers.base import OuterProductRule
from dattri_llm.gradient.layers.embedding import EmbeddingRule
from dattri_llm.gradient.ops import ProjectionConfig
from dattri_llm.gradient.ops.projection import (
    clear_projection_cache,
    layer_projection,
    mask_indices,
    project_gradient,
    projection_cache_info,
    projection_matrix,
)
from tests.helpers.projection import B1, B2, T, V, capture, loss_fn, make_batch, matrix_forms, net
from tests.helpers.reference import assert_same_formula, per_sample_grads, rel_err


def explicit(cfg: ProjectionConfig | None, m: torch.Tensor) -> torch.Tensor:
    """The explicit projection ``(B, dim)`` of matrix forms ``m`` ``(B, K, D)``."""
    b, k, d = m.shape
    if cfg is None:
        return m.reshape(b, -1)
    ptype = cfg.projector_options.get("proj_type", "normal")
    if cfg.style == "logra":
        o = cfg.projector_options
        row = projection_matrix(k, o["proj_dim_out"], cfg.seed + 1, ptype, m.dtype)
        col = projection_matrix(d, o["proj_dim_in"], cfg.seed, ptype, m.dtype)
        return (row.T @ m @ col).reshape(b, -1)
    if cfg.style == "dense":
        return m.reshape(b, -1) @ projection_matrix(k * d, cfg.proj_dim, cfg.seed, ptype, m.dtype)
    return m.reshape(b, -1)[:, mask_indices(k * d, cfg.proj_dim, cfg.seed)]


def per_layer_configs(style: str) -> dict[str, ProjectionConfig]:
    norm = ProjectionConfig("mask" if style == "logra" else style, proj_dim=7, seed=3)
    if style == "logra":
        main = ProjectionConfig("logra", proj_dim_in=3, proj_dim_out=4, seed=11)
    elif style == "dense":
        main = ProjectionConfig("dense", proj_dim=20, seed=5, proj_type="rademacher")
    else:
        main = ProjectionConfig("mask", proj_dim=20, seed=7)
    return {"ln|rms": norm, ".*": main}


@pytest.mark.parametrize("capture_style", ["factorized", "materialized", "auto"])
@pytest.mark.parametrize("style", ["logra", "dense", "mask"])
def test_projected_inner_products_equal_explicit_projection(style: str, capture_style: str):
    model = net()
    b1, b2 = make_batch(B1), make_batch(B2)
    projection = per_layer_configs(style)
    cfg = HookManagerConfig(projection=projection, capture_style=capture_style)
    g1, g2 = capture(model, b1, cfg), capture(model, b2, cfg)
    m1 = matrix_forms(per_sample_grads(model, loss_fn, b1))
    m2 = matrix_forms(per_sample_grads(model, loss_fn, b2))
    configs = {n: projection["ln|rms"] if n in ("ln", "rms") else projection[".*"] for n in m1}
    r1 = {n: explicit(configs[n], m) for n, m in m1.items()}
    r2 = {n: explicit(configs[n], m) for n, m in m2.items()}
    for name, lg in g1.layers.items():
        assert lg.layer_type == f"projected.{configs[name].style}"
        assert rel_err(lg.materialize().data, r1[name]) < 1e-12, name
        for mode in ("auto", "factorized", "materialized"):
            got = ops.layer_cross_dot(lg, g2.layers[name], mode)
            assert rel_err(got, r1[name] @ r2[name].T) < 1e-12, (name, mode)
    f1, f2 = torch.cat(list(r1.values()), 1), torch.cat(list(r2.values()), 1)
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), f1 @ f2.T) < 1e-12
        assert rel_err(ops.grad_norm_sq(g1, mode=mode), (f1 * f1).sum(1)) < 1e-12
    if style == "logra" and capture_style == "factorized":
        assert isinstance(g1.layers["fc"], Factorized) and g1.layers["fc"].a.shape[-1] == 3
        assert g1.layers["emb"].g.shape[-1] == 4  # the row (vocabulary) side: R[idx]
        # logra keeps a token axis: per-token shares of the projected gradient sum to the scores
        fact = g1.select_layers(["emb", "fc", "head"])
        per_tok = ops.cross_dot_per_token(fact, g2.select_layers(["emb", "fc", "head"]))
        want = sum(r1[n] @ r2[n].T for n in ("emb", "fc", "head"))
        assert per_tok.shape == (B1, T, B2) and rel_err(per_tok.sum(1), want) < 1e-12


def test_matrices_are_dattri_projections():
    from dattri.func.projection import random_project

    x = torch.randn(5, 37)
    for ptype in ("normal", "rademacher"):
        for dim in (16, 130):  # one block and several blocks of dattri's BasicProjector
            want = random_project(
                x, 5, proj_dim=dim, proj_max_batch_size=8, proj_seed=4, proj_type=ptype
            )(x)
            got = x @ projection_matrix(37, dim, 4, ptype)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (ptype, dim)
    want = random_project(
        x, 5, proj_dim=9, proj_max_batch_size=8, proj_seed=4, proj_type="random_mask"
    )(x)
    assert torch.equal(x[:, mask_indices(37, 9, 4)], want)


def test_logra_never_materializes(monkeypatch: pytest.MonkeyPatch):
    def boom(*args, **kwargs):
        raise AssertionError("logra formed a per-sample gradient")

    for cls in (OuterProductRule, EmbeddingRule):  # the projected rule inherits these too
        monkeypatch.setattr(cls, "materialize", boom)
        monkeypatch.setattr(cls, "materialize_per_token", boom)
        monkeypatch.setattr(cls, "dense_per_token", boom)
    widths: dict[str, int] = {}

    class Spy(HookCallback):
        def on_forward(self, name, module, a):
            widths[name] = a.shape[-1] if a.is_floating_point() else -1

    model = net()
    b1, b2 = make_batch(B1), make_batch(B2)
    proj = {"ln|rms": None, ".*": ProjectionConfig("logra", proj_dim=9, seed=2)}
    cfg = HookManagerConfig(projection=proj)
    g1, g2 = capture(model, b1, cfg, [Spy()]), capture(model, b2, cfg)
    assert widths["fc"] == 3 and widths["conv"] == 3 and widths["head"] == 3  # projected in fwd
    monkeypatch.undo()
    m1 = matrix_forms(per_sample_grads(model, loss_fn, b1))
    m2 = matrix_forms(per_sample_grads(model, loss_fn, b2))
    for name in ("emb", "fc", "conv", "head"):
        r1, r2 = explicit(proj[".*"], m1[name]), explicit(proj[".*"], m2[name])
        for cls in (OuterProductRule, EmbeddingRule):
            monkeypatch.setattr(cls, "materialize", boom)
        got = ops.layer_cross_dot(g1.layers[name], g2.layers[name], mode="factorized")
        monkeypatch.undo()
        assert rel_err(got, r1 @ r2.T) < 1e-12, name


def test_mask_entries_are_exact_gradient_entries(monkeypatch: pytest.MonkeyPatch):
    def boom(*args, **kwargs):
        raise AssertionError("mask formed a dense per-sample gradient")

    for cls in (OuterProductRule, EmbeddingRule):
        monkeypatch.setattr(cls, "materialize", boom)
    model = net()
    batch = make_batch(B1)
    cfg = ProjectionConfig("mask", proj_dim=11, seed=9)
    got = capture(model, batch, HookManagerConfig(projection=cfg))
    monkeypatch.undo()
    forms = matrix_forms(per_sample_grads(model, loss_fn, batch))
    for name, m in forms.items():
        idx = mask_indices(m[0].numel(), 11, 9)
        assert idx.numel() == min(11, m[0].numel())
        assert rel_err(got.layers[name].data, m.reshape(m.shape[0], -1)[:, idx]) < 1e-13, name
        assert got.layers[name].module_kwargs["proj_dim"] == idx.numel()


def test_dict_form_none_keeps_layers_exact_and_unknown_pattern_raises():
    model = net()
    b1 = make_batch(B1)
    proj = {
        "fc": None,
        "ln|rms": ProjectionConfig("dense", proj_dim=4),
        ".*": ProjectionConfig("logra", proj_dim=4),
    }
    g = capture(model, b1, HookManagerConfig(projection=proj))
    assert g.layer_types == {
        "emb": "projected.logra",
        "fc": "nn.Linear",
        "ln": "projected.dense",
        "conv": "projected.logra",
        "rms": "projected.dense",
        "head": "projected.logra",
    }
    m = matrix_forms(per_sample_grads(model, loss_fn, b1))
    assert rel_err(g.layers["fc"].materialize().data, m["fc"].reshape(B1, -1)) < 1e-12
    with pytest.raises(ValueError, match="match no hooked layer"):
        HookManager(model, HookManagerConfig(projection={"nope": None}))
    with pytest.raises(TypeError, match="ProjectionConfig"):
        HookManagerConfig(projection={"fc": "logra"})


def test_logra_on_norm_and_bad_options_are_clear_errors():
    model = net()
    with pytest.raises(
        ValueError, match=r"'ln' \(nn.LayerNorm\).*'logra'.*\['dense', 'mask', 'sparse'\]"
    ):
        HookManager(
            model, HookManagerConfig(projection={"ln": ProjectionConfig("logra", proj_dim=4)})
        )  # asked of the layer by name: refused (a whole-model config adapts, see below)
    with pytest.raises(ValueError, match="perfect square"):
        ProjectionConfig("logra", proj_dim=12)
    assert (
        ProjectionConfig("logra", proj_dim=12, proj_dim_in=3).projector_options["proj_dim_out"] == 4
    )
    with pytest.raises(ValueError, match="unknown projector options"):
        ProjectionConfig("mask", proj_dim=4, proj_type="normal")
    with pytest.raises(ValueError, match="proj_type"):
        ProjectionConfig("dense", proj_dim=4, proj_type="sjlt")
    with pytest.raises(ValueError, match="style"):
        ProjectionConfig("trak", proj_dim=4)
    with pytest.raises(ValueError, match="param_grad"):
        HookManager(
            model,
            HookManagerConfig(param_grad=["fc"], projection=ProjectionConfig("mask", proj_dim=4)),
        )


def test_same_seed_same_matrices_across_managers_and_cached_per_step():
    model = net()
    batch = make_batch(B1)
    cfg = HookManagerConfig(
        projection={
            "ln|rms": ProjectionConfig("mask", proj_dim=5),
            ".*": ProjectionConfig("logra", proj_dim=16, seed=1),
        }
    )
    clear_projection_cache()
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, config=cfg, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        loss_fn(model, batch).backward()
        generated = projection_cache_info()["generated"]
        for _ in range(2):
            loss_fn(model, batch).backward()
    assert generated > 0 and projection_cache_info()["generated"] == generated  # reused
    first = {k: v.clone() for k, v in hm.projection["fc"].matrices(torch.float64).items()}
    clear_projection_cache()  # a second manager (another process) regenerates them from seeds
    hm2 = HookManager(model, config=cfg)
    again = hm2.projection["fc"].matrices(torch.float64)
    hm2.remove()
    assert all(torch.equal(first[k], again[k]) for k in first)
    g_a, g_b = cb.records[0].gradient, capture(model, batch, cfg)
    assert_same_formula(ops.pairwise_dot(g_a), ops.pairwise_dot(g_b))
    other = HookManagerConfig(
        projection={"ln|rms": None, ".*": ProjectionConfig("logra", proj_dim=16, seed=2)}
    )
    assert not torch.allclose(
        ops.pairwise_dot(capture(model, batch, other).select_layers(["fc"])),
        ops.pairwise_dot(g_b.select_layers(["fc"])),
    )


def test_projected_layers_survive_the_data_model_and_rebuild_from_module_kwargs():
    model = net()
    b1, b2 = make_batch(B1), make_batch(B2)
    proj = {
        "ln|rms": ProjectionConfig("dense", proj_dim=6, seed=4),
        "fc": ProjectionConfig("mask", proj_dim=10),
        ".*": ProjectionConfig("logra", proj_dim=9, seed=8),
    }
    cfg = HookManagerConfig(projection=proj)
    g1, g2 = capture(model, b1, cfg), capture(model, b2, cfg)
    both = Gradient.concatenate([g1, g2])
    assert both.batch_size == B1 + B2
    assert rel_err(ops.cross_dot(both.slice([4, 5, 6]), g1), ops.cross_dot(g2, g1)) < 1e-13
    as32 = both.to(torch.float32)
    assert as32.dtype == torch.float32 and as32.layers["emb"].g.dtype == torch.float32
    for name, lg in g1.layers.items():
        kw = json.loads(json.dumps(lg.module_kwargs))  # what a store writes and reads back
        style = lg.layer_type.split(".")[1]
        opts = {k: kw[k] for k in ("proj_dim_in", "proj_dim_out", "proj_type") if k in kw}
        dim = None if style == "logra" else kw["proj_dim"]
        cfg_back = ProjectionConfig(style, proj_dim=dim, seed=kw["seed"], **opts)
        lp = layer_projection(cfg_back, kw["source_layer_type"], kw["source_module_kwargs"])
        assert lp.module_kwargs == kw
        # the rebuilt projection reproduces the capture from the exact gradient
        exact = capture(model, b1, HookManagerConfig()).select_layers([name])
        again = project_gradient(exact, {name: cfg_back})
        assert rel_err(again.layers[name].materialize().data, lg.materialize().data) < 1e-12


@pytest.mark.parametrize("style", ["logra", "dense", "mask"])
def test_tied_embedding_and_head_stay_one_parameter(style: str):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, 6)
            self.fc = nn.Linear(6, 6)
            self.head = nn.Linear(6, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.fc(self.emb(input_ids))))

    def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"])
        return nn.functional.cross_entropy(
            logits.reshape(-1, V), batch["t"].reshape(-1), reduction="sum"
        )

    torch.manual_seed(0)
    model = Tied().double()
    dim = 16 if style == "logra" else 12
    cfg = ProjectionConfig(style, proj_dim=dim, seed=6)
    batches = [
        {"input_ids": torch.randint(0, V, (b, T)), "t": torch.randint(0, V, (b, T))}
        for b in (B1, B2)
    ]
    grads = []
    for batch in batches:
        cb = CaptureCallback()
        hm = HookManager(model, HookManagerConfig(projection=cfg), callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            lm_loss(model, batch).backward()
        grads.append(cb.pop().gradient)
    assert "head" not in grads[0].layers
    assert isinstance(grads[0].layers["emb"], Shared if style == "logra" else Materialized)
    refs = []
    for batch in batches:
        ref = per_sample_grads(model, lm_loss, batch)
        fc = torch.cat([ref["fc.weight"], ref["fc.bias"][..., None]], -1)
        refs.append(torch.cat([explicit(cfg, ref["emb.weight"]), explicit(cfg, fc)], 1))
    for mode in ("auto", "factorized", "materialized"):
        got = ops.cross_dot(grads[0], grads[1], mode=mode)
        assert rel_err(got, refs[0] @ refs[1].T) < 1e-12, mode


def test_llama_rmsnorm_recipe_projected_and_unprojected_equal_autograd():
    transformers = pytest.importorskip("transformers")
    from dattri_llm.utils.module import rms_norm_module_kwargs

    torch.manual_seed(0)
    model = (
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=37,
                hidden_size=16,
                intermediate_size=24,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=16,
                attn_implementation="eager",
            )
        )
        .double()
        .eval()
    )
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.add_(torch.randn(16, dtype=torch.float64) * 0.2)

    def causal_loss(m: nn.Module, batch: dict) -> torch.Tensor:
        logits = m(input_ids=batch["input_ids"]).logits[:, :-1]
        return nn.functional.cross_entropy(
            logits.reshape(-1, 37), batch["input_ids"][:, 1:].reshape(-1), reduction="sum"
        )

    def recipe(projection: object) -> HookManagerConfig:
        return HookManagerConfig(
            hook_types={"model.norm": "linear_io"},
            layer_types={"model.norm": "nn.RMSNorm"},
            module_kwargs={
                "model.norm": rms_norm_module_kwargs(
                    normalized_shape=norm.weight.shape[0], eps=norm.variance_epsilon
                )
            },
            projection=projection,
        )

    batches = [{"input_ids": torch.randint(0, 37, (b, 6))} for b in (3, 2)]
    ref = [per_sample_grads(model, causal_loss, b)["model.norm.weight"] for b in batches]
    for proj in (
        None,
        ProjectionConfig("dense", proj_dim=8, seed=1),
        ProjectionConfig("mask", proj_dim=8, seed=1),
    ):
        got = []
        for batch in batches:
            cb = CaptureCallback()
            hm = HookManager(model, recipe(proj), callbacks=[cb])
            with hm.collect(deregister_on_exit=True):
                causal_loss(model, batch).backward()
            model.zero_grad(set_to_none=True)
            got.append(cb.pop().gradient)
        want = [explicit(proj, r[:, None, :]) for r in ref]
        # LlamaRMSNorm normalises in float32 internally; the rule normalises in float64
        assert rel_err(got[0].layers["model.norm"].materialize().data, want[0]) < 1e-6
        for mode in ("auto", "factorized", "materialized"):
            assert rel_err(ops.cross_dot(got[0], got[1], mode=mode), want[0] @ want[1].T) < 1e-6
    with pytest.raises(ValueError, match="'logra'"):
        HookManager(model, recipe({r"model\.norm": ProjectionConfig("logra", proj_dim=4)}))


def test_missing_dattri_names_the_extra(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "dattri", None)
    monkeypatch.setitem(sys.modules, "dattri.func", None)
    model = net()
    for style in ("logra", "dense"):
        cfg = {"ln|rms": None, ".*": ProjectionConfig(style, proj_dim=4)}
        with pytest.raises(ImportError, match=r"dattri_llm\[attribution\]"):
            HookManager(model, HookManagerConfig(projection=cfg))
    hm = HookManager(model, HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=4)))
    hm.remove()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("proj_dim", [9, 16])
def test_whole_model_logra_applies_to_each_layer_in_the_nearest_form_it_takes(
    family, proj_dim, tmp_path
):
    """``ProjectionConfig("logra")`` for the whole model: every layer that takes logra gets it;
    a norm (which does not) with at most ``proj_dim`` parameters stays exact, a larger one
    gets ``dense`` of the same ``proj_dim``, seed and ``proj_type``; as ``project_gradient``
    of an exact capture does, and as the store records it per layer."""
    pytest.importorskip("transformers")
    pytest.importorskip("dattri")
    from dattri_llm.cli.inspect_store import describe_projection
    from dattri_llm.gradient.callbacks.offload import OffloadCallback
    from dattri_llm.gradient.ops.projection import project_gradient
    from dattri_llm.gradient.store import GradientStorageManager
    from tests.helpers.hf_families import build

    model = build(family)  # hidden 16: a norm of 16 (Llama) or 32 (GPT-2, with bias) parameters
    cfg = ProjectionConfig("logra", proj_dim, seed=5, proj_type="rademacher")
    x = {"input_ids": torch.randint(0, 37, (2, 6))}

    def run(projection: object, store: object = None) -> tuple:
        cb = CaptureCallback()
        cbs = [cb] + ([OffloadCallback(file_manager=store)] if store is not None else [])
        hm = HookManager(model, HookManagerConfig(projection=projection), callbacks=cbs)
        with hm.collect(deregister_on_exit=True):
            model(**x, labels=x["input_ids"]).loss.backward()
        model.zero_grad(set_to_none=True)
        return hm, cb.pop().gradient

    store = GradientStorageManager(tmp_path / "store", mode="create")
    hm, got = run(cfg, store)
    store.close()
    stored = GradientStorageManager(tmp_path / "store").load_record(0).gradient
    _, exact = run(None)
    want = project_gradient(exact, cfg)
    norms = 0
    for spec in hm.layers:
        if spec.name not in got.layers:  # a tied site (GPT-2's head), under its lead (wte)
            continue
        n_params = sum(p.numel() for p in spec.module.parameters(recurse=False))
        lg = got.layers[spec.name]
        if "Norm" not in type(spec.module).__name__:
            expected = "projected.logra"
        else:
            norms += 1
            expected = spec.rule.layer_type if n_params <= proj_dim else "projected.dense"
        assert lg.layer_type == expected, (spec.name, lg.layer_type)
        assert stored.layers[spec.name].layer_type == expected
        if expected == "projected.dense":
            kw = lg.module_kwargs
            assert (kw["proj_dim"], kw["seed"], kw["proj_type"]) == (proj_dim, 5, "rademacher")
            assert describe_projection(expected, stored.layers[spec.name].module_kwargs).startswith(
                f"dense dim {proj_dim}, seed 5, rademacher; of "
            )
        a, b = lg.materialize(), want.layers[spec.name].materialize()
        assert a.layer_type == b.layer_type and rel_err(a.data, b.data) < 1e-10, spec.name
    assert norms >= 2
