"""Hugging Face families under ``REGISTER_ALL`` alone: every trainable parameter captured, exactly.

Each family is built from a small config (random weights, eval mode). The per-sample gradient
of every captured parameter is compared with one ``backward()`` per sample in float64; the
known norm classes (``LlamaRMSNorm``, Gemma's ``(1 + weight)`` norm, OLMo-2's, ...) and Gemma's
scaled embedding are recognised by class name (``gradient/layers/hf_classes.py``). MoE models
run in float32 here (transformers' grouped expert kernels refuse float64); their fused experts
and routers are captured by ``gradient/layers/moe.py`` (float64 checks: ``test_moe.py``).
"""

from __future__ import annotations

import json
import logging
import re
import warnings

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
)
from dattri_llm.cli import main
from dattri_llm.gradient.layers import hf_classes
from tests.helpers.hf_families import FAMILIES, MOE_FAMILIES, build
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err

pytest.importorskip("transformers")

DENSE = [f for f in FAMILIES if f not in MOE_FAMILIES]


def causal_sum_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (a sample's loss does not depend on the batch)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def capture_all(
    model: nn.Module, ids: torch.Tensor, exclude: tuple[str, ...] = ()
) -> tuple[HookManager, dict, list[str]]:
    """``REGISTER_ALL`` capture of one batch: manager, ``{param: (B, *shape)}``, warnings."""
    cb = CaptureCallback()
    config = HookManagerConfig(linear_io=REGISTER_ALL, exclude=list(exclude))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookManager(model, config, callbacks=[cb])
        with hm.collect():
            causal_sum_loss(model, ids).backward()
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    hm.remove()
    model.zero_grad(set_to_none=True)
    return hm, got, [str(w.message) for w in caught]


def tolerance(model: nn.Module, name: str, exact: float) -> float:
    """``exact``, except for a Gemma-form norm weight: Gemma multiplies ``1 + weight.float()`` in
    float32, so autograd's own gradient of that weight carries float32 round-off (~1e-7)."""
    module = model.get_submodule(name.rpartition(".")[0])
    form = hf_classes.hf_norm_form(module)
    return 1e-6 if form is not None and form.name == "gemma" else exact


@pytest.mark.parametrize("family", DENSE)
def test_dense_family_captures_every_parameter_exactly(family: str) -> None:
    model = build(family, torch.float64)
    ids = torch.randint(1, 37, (3, 7))
    hm, got, warned = capture_all(model, ids)
    assert warned == []
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable
    assert hm.coverage().fraction == 1.0
    ref = per_sample_loop_grads(model, causal_sum_loss, ids)
    for name in trainable:
        assert rel_err(got[name], ref[name]) < tolerance(model, name, 1e-12), name


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_family_captures_every_parameter_exactly(family: str) -> None:
    """float32 (transformers' grouped expert kernels refuse float64; test_moe.py checks
    the experts in float64 with the eager kernels): experts, routers, shared experts and the
    RMS norms all captured under ``REGISTER_ALL`` alone, with no warning."""
    model = build(family, torch.float32)
    ids = torch.randint(1, 37, (2, 6))
    hm, got, warned = capture_all(model, ids)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable and not warned, (trainable - set(got), warned)
    assert hm.coverage().fraction == 1.0 and not hm.coverage().left_out
    ref = per_sample_loop_grads(model, causal_sum_loss, ids)
    for name in got:
        assert rel_err(got[name], ref[name]) < 1e-4, name


class CenteredRMSNorm(nn.Module):
    """Looks like LlamaRMSNorm (weight, variance_epsilon) but subtracts the mean: a LayerNorm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(d))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _norm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 6), CenteredRMSNorm(6), nn.Linear(6, 3)).double()


def test_wrong_registry_entry_is_caught_by_the_coverage_check(monkeypatch) -> None:
    monkeypatch.setattr(hf_classes, "_NORMS", dict(hf_classes._NORMS))
    hf_classes.register_hf_norm("CenteredRMSNorm", "llama")  # wrong: its maths is LayerNorm's
    model = _norm_model()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    assert hm.layers[1].rule.layer_type == "nn.RMSNorm"
    with pytest.warns(UserWarning, match=r"layer '1'.*differs from autograd's"):
        with hm.collect(deregister_on_exit=True):
            model(torch.randn(4, 2, 5, dtype=torch.float64)).pow(2).sum().backward()


def test_unknown_norm_class_still_warns_and_unknown_form_is_refused() -> None:
    model = _norm_model()
    with pytest.warns(UserWarning, match=r"1\.weight \(a CenteredRMSNorm\)"):
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    assert hm.layer_names == ["0", "2"]
    hm.remove()
    with pytest.raises(ValueError, match="form='layer'.*expected one of"):
        hf_classes.register_hf_norm("X", "layer")


def test_same_named_class_of_another_shape_is_not_recognised() -> None:
    class LlamaRMSNorm(nn.Module):  # a user's class of the same name, eps elsewhere
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    assert hf_classes.hf_norm_form(LlamaRMSNorm()) is None


def test_explicit_layer_types_and_module_kwargs_win_over_the_registry() -> None:
    model = build("llama", torch.float64)
    config = HookManagerConfig(
        linear_io=REGISTER_ALL,
        layer_types={"model.norm": "nn.RMSNorm"},
        module_kwargs={"model.norm": {"eps": 0.5}},
    )
    hm = HookManager(model, config)
    specs = {s.name: s for s in hm.layers}
    assert specs["model.norm"].module_kwargs["eps"] == 0.5
    assert specs["model.layers.0.input_layernorm"].module_kwargs["eps"] == 1e-6
    hm.remove()


def test_gemma_scaled_embedding_records_its_scale() -> None:
    model = build("gemma", torch.float64)
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    specs = {s.name: s for s in hm.layers}
    assert specs["model.embed_tokens"].module_kwargs["output_scale"] == 4.0  # sqrt(16)
    assert "output_scale" not in {
        k for s in hm.layers if s.name != "model.embed_tokens" for k in s.module_kwargs
    }
    hm.remove()


def test_coverage_counts_logs_is_stored_and_inspected(tmp_path, caplog, capsys) -> None:
    """Mixtral with its expert blocks and routers excluded: they are what is left out."""
    model = build("mixtral", torch.float32)
    params = dict(model.named_parameters())
    left = [n for n in params if ".mlp.experts." in n or ".mlp.gate." in n]
    total = sum(p.numel() for p in params.values())
    store = GradientStorageManager(tmp_path / "store")
    config = HookManagerConfig(linear_io=REGISTER_ALL, exclude=[r".*\.mlp\.(experts|gate)"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the uncaptured-parameter warning, tested above
        hm = HookManager(model, config, callbacks=[OffloadCallback(file_manager=store)])
    cov = hm.coverage()
    assert cov.total == total and list(cov.left_out) == left
    assert cov.captured == total - sum(params[n].numel() for n in left)
    assert 0 < cov.fraction < 1 and cov.to_dict()["left_out"] == left
    with caplog.at_level(logging.INFO, logger="dattri_llm.capture"):
        with hm.collect(deregister_on_exit=True):
            for _ in range(2):  # logged at the first step only
                causal_sum_loss(model, torch.randint(1, 37, (2, 5))).backward()
    lines = [r.getMessage() for r in caplog.records if r.name == "dattri_llm.capture"]
    assert lines == [f"HookManager captures {cov}"]
    assert f"{cov.fraction:.1%} of the trainable parameters" in lines[0]
    meta = json.loads((tmp_path / "store" / "meta.json").read_text())
    assert meta["coverage"] == cov.to_dict()
    assert main(["inspect", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"\ncoverage +{cov.fraction:.1%} of the trainable parameters \(", out)
    assert "left out: model.layers.0.mlp.gate.weight" in out


def test_coverage_of_a_frozen_base_counts_trainable_parameters_only() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    hm = HookManager(model)
    assert (hm.coverage().captured, hm.coverage().total, hm.coverage().left_out) == (10, 10, ())
    hm.remove()


class BiasedTestRMSNorm(nn.Module):
    """A Llama-form RMS norm with a bias (``weight * x_hat + bias``), registered by name."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(d))
        self.bias = nn.Parameter(0.1 * torch.randn(d))
        self.variance_epsilon = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype) + self.bias


def test_registered_norm_with_bias_is_exact(monkeypatch) -> None:
    monkeypatch.setattr(hf_classes, "_NORMS", dict(hf_classes._NORMS))
    hf_classes.register_hf_norm("BiasedTestRMSNorm", hf_classes.HF_NORM_FORMS["llama"])
    model = nn.Sequential(nn.Linear(5, 6), BiasedTestRMSNorm(6), nn.Linear(6, 3)).double()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    cb = CaptureCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            model(x).pow(2).sum().backward()
    assert hm.layers[1].module_kwargs["bias"] is True
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    model.zero_grad(set_to_none=True)
    ref = per_sample_loop_grads(model, lambda m, xi: m(xi).pow(2).sum(), x)
    assert set(got) == set(ref)
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-12, name


def test_a_model_loaded_with_from_pretrained_is_covered_the_same(tmp_path) -> None:
    """Gemma saved and reloaded: the norms and the scaled embedding (its non-persistent
    ``embed_scale`` buffer is rebuilt on loading) are recognised, and the capture is exact."""
    import transformers

    build("gemma", torch.float64).save_pretrained(tmp_path / "gemma")
    model = transformers.GemmaForCausalLM.from_pretrained(tmp_path / "gemma", dtype=torch.float64)
    model.eval()
    ids = torch.randint(1, 37, (2, 6))
    hm, got, warned = capture_all(model, ids)
    assert warned == [] and hm.coverage().fraction == 1.0
    assert {s.name: s for s in hm.layers}["model.embed_tokens"].module_kwargs["output_scale"] == 4.0
    ref = per_sample_loop_grads(model, causal_sum_loss, ids)
    for name in ref:
        assert rel_err(got[name], ref[name]) < tolerance(model, name, 1e-12), name
