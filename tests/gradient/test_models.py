"""Whole Hugging Face models from configs: hooked per-sample Gram == torch.func reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Shared, ops
from dattri_llm.utils.module import rms_norm_module_kwargs
from tests.helpers.reference import flat, per_sample_grads, rel_err

transformers = pytest.importorskip("transformers")


def tiny_gpt2(**kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=37,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
        **kw,
    )
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).double().eval()


def causal_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Summed next-token loss; labels -100 (padding) contribute nothing."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    labels = batch.get("labels", batch["input_ids"])
    logits = out.logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        reduction="sum",
        ignore_index=-100,
    )


def capture(model: nn.Module, batch: dict, config: HookManagerConfig | None = None):
    cb = CaptureCallback()
    hm = HookManager(model, config=config, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        causal_loss(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return cb.pop()


def test_gpt2_default_capture_matches_torch_func() -> None:
    model = tiny_gpt2()
    b1 = {"input_ids": torch.randint(0, 37, (3, 7))}
    b2 = {"input_ids": torch.randint(0, 37, (2, 7))}
    g1, g2 = capture(model, b1).gradient, capture(model, b2).gradient
    # tied wte / lm_head are one parameter; wpe is captured per sample
    assert isinstance(g1.layers["transformer.wte"], Shared)
    assert "transformer.wpe" in g1.layers
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(lg.rule.num_params(lg.module_kwargs) for lg in g1.layers.values()) == n_params
    r1 = flat(per_sample_grads(model, causal_loss, b1))
    r2 = flat(per_sample_grads(model, causal_loss, b2))
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-9, mode
    assert rel_err(ops.grad_norm_sq(g1), (r1 * r1).sum(1)) < 1e-9


def test_gpt2_padded_batch_padding_contributes_nothing() -> None:
    model = tiny_gpt2()
    ids = torch.randint(1, 37, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    padded = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    g = capture(model, padded).gradient
    short = {"input_ids": ids[:1, :4]}
    g_short = capture(model, short).gradient
    # sample 0 padded to 6 tokens has exactly the gradient of its 4-token version
    assert (
        rel_err(ops.cross_dot(g.slice([0]), g.slice([0])), ops.cross_dot(g_short, g_short)) < 1e-9
    )
    per_tok = ops.cross_dot_per_token(
        g.select_layers(["transformer.h.0.mlp.c_fc"]), g.select_layers(["transformer.h.0.mlp.c_fc"])
    )
    assert torch.all(per_tok[0, 4:] == 0)


def test_gpt2_gradient_checkpointing_matches() -> None:
    model = tiny_gpt2()
    batch = {"input_ids": torch.randint(0, 37, (2, 7))}
    ref = capture(model, batch).gradient
    model.train()
    for p in model.modules():
        if hasattr(p, "p"):
            p.p = 0.0  # dropout off, checkpointing on
    model.config.attn_pdrop = model.config.resid_pdrop = model.config.embd_pdrop = 0.0
    model.gradient_checkpointing_enable()
    got = capture(model, batch).gradient
    assert rel_err(ops.pairwise_dot(got), ops.pairwise_dot(ref)) < 1e-10


def test_llama_rmsnorm_recipe_matches_torch_func() -> None:
    model = tiny_llama()
    norms = [n for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms
    config = HookManagerConfig(
        layer_types={n: "nn.RMSNorm" for n in norms},
        module_kwargs={
            n: rms_norm_module_kwargs(
                normalized_shape=model.get_submodule(n).weight.shape[0],
                eps=model.get_submodule(n).variance_epsilon,
            )
            for n in norms
        },
        linear_io=[".*_proj", "lm_head", "model.embed_tokens", *norms],
    )
    with torch.no_grad():
        for n in norms:
            model.get_submodule(n).weight.add_(torch.randn(16, dtype=torch.float64) * 0.2)
    b1 = {"input_ids": torch.randint(0, 37, (3, 6))}
    b2 = {"input_ids": torch.randint(0, 37, (2, 6))}
    g1, g2 = capture(model, b1, config).gradient, capture(model, b2, config).gradient
    assert g1.layer_types["model.norm"] == "nn.RMSNorm"
    r1 = flat(per_sample_grads(model, causal_loss, b1))
    r2 = flat(per_sample_grads(model, causal_loss, b2))
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-9, mode


def test_known_hf_norm_classes_are_captured_by_register_all() -> None:
    """LlamaRMSNorm is recognised by name (unknown classes: layers/test_hf_classes.py)."""
    model = tiny_llama()
    hm = HookManager(model)
    assert hm.layers[hm.layer_names.index("model.norm")].rule.layer_type == "nn.RMSNorm"
    assert "model.layers.0.self_attn.q_proj" in hm.layer_names
    hm.remove()
