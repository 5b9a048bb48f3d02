"""A tiny fused-expert (Mixtral) model and synthetic expert gradients for the MoE tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dattri_llm.gradient.gradient import Factorized

transformers = pytest.importorskip("transformers")


V, H, I, E, K = 40, 16, 8, 4, 2


def _config(family: str):
    common = dict(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts_per_tok=K,
        max_position_embeddings=32,
    )
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=I, num_local_experts=E, **common)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=I,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=I,
            num_experts=E,
            **common,
        )
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=I, moe_intermediate_size=I, num_experts=E, head_dim=8, **common
        )
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=I, num_experts=E, **common)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            intermediate_size=I, num_local_experts=E, head_dim=8, sliding_window=8, **common
        )
    else:  # pragma: no cover
        raise KeyError(family)
    cfg._experts_implementation = "eager"
    return cfg


def build(family: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    model = model.double().eval()
    with torch.no_grad():  # HF inits some routers / biases at zero: give every one a value
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.2)
    return model


def loss_fn(model, x: torch.Tensor) -> torch.Tensor:
    """Sum over samples and positions of next-token cross-entropy (additive over samples)."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
    )


def synthetic(ids: torch.Tensor, seed: int) -> Factorized:
    """A ``moe.experts`` layer of 4 experts (K=2, D=3) with the given slot experts."""
    gen = torch.Generator().manual_seed(seed)
    b, s = ids.shape
    kw = {"num_experts": 4, "param": "down_proj", "in_features": 3, "out_features": 2}
    kw.update(family="MixtralExperts", transposed=False, bias=False)
    feat = torch.randn(b, s, 3, generator=gen, dtype=torch.float64)
    a = torch.cat([feat, ids.to(torch.float64).unsqueeze(-1)], -1)
    g = torch.randn(b, s, 2, generator=gen, dtype=torch.float64)
    return Factorized(a, g, "moe.experts", kw)
