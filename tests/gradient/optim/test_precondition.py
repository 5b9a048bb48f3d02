"""Preconditioned capture (``HookManager(optimizer=...)``) against the optimizer maths by hand.

Reference: per-sample gradients by ``torch.func`` (``vmap(grad)``), mapped through torch's own
SGD / Adam / AdamW update rules written out in ``trajectory_reference`` (itself checked against
the real ``optimizer.step()`` on a copy), laid out in the library's matrix form by hand. Model:
Embedding + LayerNorm + Linear + an LM head tied to the embedding, float64, an optimizer
warm-started by a few real steps with non-default hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import HookManager, HookManagerConfig, OptimizerStateCallback, ProjectionConfig
from dattri_llm.gradient.callbacks import CaptureCallback
from dattri_llm.gradient.ops.projection import mask_indices, projection_matrix
from tests.helpers.precondition import LAYERS, OPTIMIZERS, capture, raw_then_mapped, warm_started
from tests.helpers.trajectory import (
    DT,
    direction_by_real_step,
    explicit_directions,
    layer_rows,
    lm_batch,
    lm_loss_row,
    lm_sample_losses,
    make_lm,
    per_sample_grads,
    rel_err,
)


def _groups(model, **kw):
    return [{"params": list(model.parameters()), **kw}]


def explicit_gamma(model, opt, batch, scale: float = 1.0) -> dict[str, torch.Tensor]:
    grads = per_sample_grads(model, lm_loss_row, batch)
    grads = {k: v * scale for k, v in grads.items()}
    return layer_rows(model, explicit_directions(model, opt, grads), LAYERS), grads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gamma_equals_optimizer_maths_by_hand(name):
    model, opt = warm_started(name)
    batch = lm_batch(3, seed=7)
    rec = capture(model, opt, batch)
    assert rec.gradient.layer_names == LAYERS
    ref, grads = explicit_gamma(model, opt, batch)
    for layer in LAYERS:
        got = rec.gradient.layers[layer].materialize().data
        assert got.dtype == DT
        assert rel_err(got, ref[layer]) <= 1e-10, layer
    # the reference itself is torch's update: a real step on a copy with p.grad = g_z
    oracle = layer_rows(
        model, {k: v[None] for k, v in direction_by_real_step(model, opt, grads, 1).items()}, LAYERS
    )
    for layer in LAYERS:
        assert rel_err(ref[layer][1:2], oracle[layer]) <= 1e-8, layer
    # metadata: the learning rate(s) and Adam's own update count
    lrs = sorted({g["lr"] for g in opt.param_groups})
    if len(lrs) == 1:
        assert rec.metadata["learning_rate"] == lrs[0]
    else:
        assert rec.metadata["learning_rates"] == lrs
    if not isinstance(opt, torch.optim.SGD):
        st = opt.state.get(model.fc.weight)
        count = int(st["step"]) + 1 if st else 1
        assert rec.metadata["preconditioned"]["optimizer_step"] == count


def test_amsgrad_case_exercises_the_running_maximum():
    """Guard: the AMSGrad case above is not vacuous (v_max wins on some coordinates only)."""
    model, opt = warm_started("adamw_amsgrad")
    batch = lm_batch(3, seed=7)
    grads = per_sample_grads(model, lm_loss_row, batch)
    b2 = opt.param_groups[0]["betas"][1]
    won = total = 0
    for name, p in model.named_parameters():
        st = opt.state[p]
        v = b2 * st["exp_avg_sq"] + (1 - b2) * grads[name] ** 2
        won += int((st["max_exp_avg_sq"] > v).sum())
        total += v.numel()
    assert 0.05 < won / total < 0.95


def test_mask_and_dense_after_the_map_equal_projecting_explicit_gamma():
    model, opt = warm_started("adamw_amsgrad")
    batch = lm_batch(3, seed=8)
    mask = ProjectionConfig("mask", proj_dim=10, seed=3)
    dense = ProjectionConfig("dense", proj_dim=8, seed=5)
    # tied emb/head masked, fc dense, norm exact
    config = HookManagerConfig(projection={"emb|head": mask, "fc": dense})
    rec = capture(model, opt, batch, config=config)
    ref, _ = explicit_gamma(model, opt, batch)
    emb = rec.gradient.layers["emb"].materialize().data
    idx = mask_indices(ref["emb"].shape[1], 10, 3)
    assert emb.shape == (3, 10)
    assert rel_err(emb, ref["emb"][:, idx]) <= 1e-10
    fc = rec.gradient.layers["fc"].materialize().data
    mat = projection_matrix(ref["fc"].shape[1], 8, 5, dtype=DT)
    assert fc.shape == (3, 8)
    assert rel_err(fc, ref["fc"] @ mat) <= 1e-10
    assert rel_err(rec.gradient.layers["norm"].materialize().data, ref["norm"]) <= 1e-10
    # all layers masked / all dense, with an SGD momentum map
    model, opt = warm_started("sgd_momentum_dampening_wd")
    for cfg in (mask, dense):
        rec = capture(model, opt, batch, config=HookManagerConfig(projection=cfg))
        ref, _ = explicit_gamma(model, opt, batch)
        for layer in LAYERS:
            got = rec.gradient.layers[layer].materialize().data
            k = ref[layer].shape[1]
            want = (
                ref[layer][:, mask_indices(k, 10, 3)]
                if cfg.style == "mask"
                else ref[layer] @ projection_matrix(k, 8, 5, dtype=DT)
            )
            assert rel_err(got, want) <= 1e-10, (cfg.style, layer)


def test_precondition_scale_batch_size_under_a_mean_loss():
    """A mean loss captures ∇ℓ/B; ``"batch_size"`` maps the sample's own ∇ℓ (Γ is not
    scale-free)."""
    model, opt = warm_started("adam_coupled_wd")
    batch = lm_batch(4, seed=9)
    own, _ = explicit_gamma(model, opt, batch, scale=1.0)
    share, _ = explicit_gamma(model, opt, batch, scale=1 / 4)
    rec = capture(model, opt, batch, reduction="mean", precondition_scale="batch_size")
    rec_share = capture(model, opt, batch, reduction="mean")
    rec_num = capture(model, opt, batch, reduction="mean", precondition_scale=2.0)
    by_two, _ = explicit_gamma(model, opt, batch, scale=2 / 4)
    for layer in LAYERS:
        assert rel_err(rec.gradient.layers[layer].materialize().data, own[layer]) <= 1e-10
        assert rel_err(rec_share.gradient.layers[layer].materialize().data, share[layer]) <= 1e-10
        assert rel_err(rec_num.gradient.layers[layer].materialize().data, by_two[layer]) <= 1e-10
        # non-vacuous: the two maps differ
        assert rel_err(own[layer], share[layer]) > 1e-3
    assert rec.metadata["preconditioned"]["scale"] == "batch_size"


def test_raw_gradients_context_turns_the_map_off():
    model, opt = warm_started("adamw_amsgrad")
    batch = lm_batch(3, seed=11)
    raw, pre = raw_then_mapped(model, opt, batch)
    grads = per_sample_grads(model, lm_loss_row, batch)
    ref_raw = layer_rows(model, grads, LAYERS)
    ref_pre, _ = explicit_gamma(model, opt, batch)
    assert "preconditioned" not in raw.metadata and "preconditioned" in pre.metadata
    for layer in LAYERS:
        assert rel_err(raw.gradient.layers[layer].materialize().data, ref_raw[layer]) <= 1e-10
        assert rel_err(pre.gradient.layers[layer].materialize().data, ref_pre[layer]) <= 1e-10


# ---- refusals ------------------------------------------------------------------------------------
def test_logra_projection_refused():
    model, opt = warm_started("adamw_first_step")
    config = HookManagerConfig(projection={"fc": ProjectionConfig("logra", proj_dim=4)})
    with pytest.raises(ValueError, match="logra") as e:
        HookManager(model, config=config, optimizer=opt)
    assert "'fc'" in str(e.value) and "mask" in str(e.value)
    HookManager(model, config=config).remove()  # fine without the map


def test_param_grad_layers_refused():
    model, opt = warm_started("adamw_first_step")
    config = HookManagerConfig(linear_io=["fc"], param_grad=["norm"])
    with pytest.raises(ValueError, match="param_grad") as e:
        HookManager(model, config=config, optimizer=opt)
    assert "'norm'" in str(e.value)


def test_unsupported_optimizer_refused_naming_the_supported_ones():
    model = make_lm()
    rms = torch.optim.RMSprop(model.parameters(), lr=0.01)
    for build in (
        lambda: HookManager(model, optimizer=rms),
        lambda: OptimizerStateCallback(model, rms),
    ):
        with pytest.raises(TypeError, match="RMSprop") as e:
            build()
        msg = str(e.value)
        assert "torch.optim.SGD" in msg and "torch.optim.Adam" in msg and "torch.optim.AdamW" in msg

    class MyAdam(torch.optim.Adam):  # a subclass that changes the update is not Adam
        def step(self, closure=None):  # noqa: D102
            return super().step(closure)

    with pytest.raises(TypeError, match="MyAdam"):
        HookManager(model, optimizer=MyAdam(model.parameters()))
    # a factory (trainers that build the optimizer late) is resolved at capture and refused then
    hm = HookManager(model, callbacks=[CaptureCallback()], optimizer=lambda: rms)
    batch = lm_batch(2, seed=1)
    with pytest.raises(TypeError, match="RMSprop"), hm.collect():
        lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
    hm.remove()


def test_parameter_outside_the_optimizer_refused():
    model = make_lm()
    opt = torch.optim.Adam([model.fc.weight, model.fc.bias], lr=0.01)
    hm = HookManager(model, callbacks=[CaptureCallback()], optimizer=opt)
    batch = lm_batch(2, seed=1)
    with pytest.raises(ValueError, match="not updated by the optimizer"), hm.collect():
        lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
    hm.remove()
    with pytest.raises(ValueError, match="precondition_scale"):
        HookManager(model, optimizer=opt, precondition_scale="mean")


def test_fsdp1_flat_parameters_in_the_optimizer_name_use_orig_params():
    """Hooks registered before an FSDP1 ``use_orig_params=False`` wrap: the optimizer then holds
    flat parameters (FSDP marks them ``_is_flat_param``), and the error says so."""
    model = make_lm()
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    flat._is_flat_param = True  # what FSDP1 sets on its FlatParameter
    opt = torch.optim.Adam([flat], lr=0.01)
    hm = HookManager(model, callbacks=[CaptureCallback()], optimizer=opt)
    batch = lm_batch(2, seed=1)
    with pytest.raises(ValueError, match=r"FSDP1 flat parameters.*use_orig_params=True"):
        with hm.collect():
            lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
    hm.remove()
