"""peft LoRA adapters under ``REGISTER_ALL``: the adapters' per-sample gradients, exactly.

The base weights are frozen by peft and left out without a warning; the adapters
(``lora_A`` / ``lora_B``, plain ``nn.Linear``) are captured like any linear layer. ``lora_B``
starts at zero (then ``lora_A`` would get no gradient), so the tests perturb it. Exactness is
against one ``backward()`` per sample, in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dattri_llm import REGISTER_ALL, CaptureCallback, HookManager, HookManagerConfig
from tests.helpers.hf_families import build
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")


def causal_sum_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def with_lora(model: nn.Module, **config) -> nn.Module:
    """``model`` with LoRA adapters (rank 4, no dropout); ``lora_B`` moved off zero."""
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **config)
    model = peft.get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def capture_exact(model: nn.Module, ids: torch.Tensor) -> tuple[HookManager, dict, dict]:
    """Capture one batch under REGISTER_ALL with no warning; ``(manager, captured, reference)``."""
    cb = CaptureCallback()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the frozen base is left out silently
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
        with hm.collect():
            causal_sum_loss(model, ids).backward()
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    hm.remove()
    model.zero_grad(set_to_none=True)
    return hm, got, per_sample_loop_grads(model, causal_sum_loss, ids)


def check_adapters_only(model: nn.Module, hm: HookManager, got: dict, ref: dict) -> None:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert set(got) == trainable  # adapters only: no base weight is captured
    assert hm.coverage().fraction == 1.0
    for name in trainable:
        assert rel_err(got[name], ref[name]) < 1e-12, name


def test_gpt2_lora_on_fused_c_attn_is_exact() -> None:
    """GPT-2's ``c_attn`` is a ``Conv1D`` (``fan_in_fan_out=True``)."""
    model = with_lora(build("gpt2"), target_modules=["c_attn"], fan_in_fan_out=True)
    hm, got, ref = capture_exact(model, torch.randint(0, 37, (3, 7)))
    check_adapters_only(model, hm, got, ref)
    assert any(n.endswith("c_attn.lora_A.default") for n in hm.layer_names)


def test_llama_lora_on_q_and_v_is_exact() -> None:
    model = with_lora(build("llama"), target_modules=["q_proj", "v_proj"])
    hm, got, ref = capture_exact(model, torch.randint(1, 37, (3, 7)))
    check_adapters_only(model, hm, got, ref)
    assert len(hm.layer_names) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)


def test_llama_lora_with_trainable_norms_captures_both() -> None:
    """``modules_to_save``-style: adapters plus the (recognised) RMS norms, all exact."""
    model = with_lora(build("llama"), target_modules=["q_proj"])
    for name, p in model.named_parameters():
        if "norm" in name:
            p.requires_grad_(True)
    hm, got, ref = capture_exact(model, torch.randint(1, 37, (2, 6)))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable and any("norm" in n for n in got)
    for name in trainable:
        assert rel_err(got[name], ref[name]) < 1e-12, name


def test_moe_expert_adapters_via_target_parameters_are_reported_not_captured() -> None:
    """peft 0.21's ``target_parameters`` adapts Mixtral's fused experts through a
    parametrization: the adapter modules' forwards never run, so hooks cannot see their use.
    The manager warns (bypass) and ``coverage()`` drops them after the step; the attention
    adapters next to them stay exact (float32: the expert kernels refuse float64)."""
    base = build("mixtral", torch.float32)
    model = with_lora(base, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    expert_adapters = {
        n for n, p in model.named_parameters() if p.requires_grad and ".experts." in n
    }
    assert expert_adapters
    cb = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    assert hm.coverage().fraction == 1.0  # before a step every adapter looks hooked
    ids = torch.randint(1, 37, (2, 6))
    with pytest.warns(UserWarning, match="forward never ran"):
        with hm.collect(deregister_on_exit=True):
            causal_sum_loss(model, ids).backward()
    assert set(hm.coverage().left_out) == expert_adapters
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    model.zero_grad(set_to_none=True)
    ref = per_sample_loop_grads(model, causal_sum_loss, ids)
    for name in got:
        if name in expert_adapters:
            assert torch.all(got[name] == 0) and ref[name].abs().max() > 0, name
        else:
            assert rel_err(got[name], ref[name]) < 1e-4, name


def test_qlora_4bit_base_frozen_adapters_exact(tmp_path) -> None:
    """QLoRA: a Llama loaded in 4-bit NF4 (bitsandbytes' CPU backend) from a saved directory,
    ``prepare_model_for_kbit_training``, LoRA on q/v. The quantized base (``Linear4bit``) is
    frozen and left out silently; the adapters are exact (the 4-bit kernels compute in float32;
    tolerance 1e-6, measured 0.0). Skipped without ``bitsandbytes``."""
    bnb = pytest.importorskip("bitsandbytes")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(  # bitsandbytes' CPU packing wants out features % 32 == 0
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    base = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "base", quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    model = with_lora(base, target_modules=["q_proj", "v_proj"])
    q_proj = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer")
    assert isinstance(q_proj, bnb.nn.Linear4bit) and not q_proj.weight.requires_grad
    cb = CaptureCallback()
    ids = torch.randint(1, 64, (3, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the frozen 4-bit base is left out silently
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            causal_sum_loss(model, ids).backward()
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    model.zero_grad(set_to_none=True)
    ref = per_sample_loop_grads(model, causal_sum_loss, ids)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == trainable and len(trainable) == 8
    assert hm.coverage().fraction == 1.0
    errors = {name: rel_err(got[name], ref[name]) for name in trainable}
    assert max(errors.values()) < 1e-6, errors  # measured: 0.0 (same kernels either way)


def test_set_adapter_after_the_manager_is_reported_and_a_new_manager_captures_it() -> None:
    """Switching the active adapter trains parameters no hook was put on: before, the step
    captured nothing and said nothing. It is now reported (no record is written), and the
    fix the warning names, a manager built after the switch, captures the new adapter exactly.
    """
    model = with_lora(build("llama"), target_modules=["q_proj"])
    model.add_adapter("second", peft.LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B.second" in name:
                p.normal_(0.0, 0.3)
    ids = torch.randint(1, 37, (2, 6))
    cb = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    model.base_model.set_adapter("second")
    with pytest.warns(UserWarning, match=r"became trainable after the HookManager was built") as w:
        with hm.collect(deregister_on_exit=True):
            causal_sum_loss(model, ids).backward()
    message = str(w[0].message)
    assert "lora_A.second.weight" in message and "no record was written" in message
    assert hm.step == 0 and cb.record is None and hm.incomplete_steps == 1
    model.zero_grad(set_to_none=True)
    hm, got, ref = capture_exact(model, ids)
    check_adapters_only(model, hm, got, ref)
    assert all(".second" in n for n in got)
