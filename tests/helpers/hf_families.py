"""Tiny Hugging Face causal LMs of each family, built from configs (random weights, offline).

Shared by the model-family tests.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: ``family: (config class, model class, extra config fields)``; all share the sizes below.
_COMMON = {
    "vocab_size": 37,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "attn_implementation": "eager",
}
_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", _MOE),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 12,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "head_dim": 8},
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
}

#: Families whose experts are fused 3-D parameters (captured once branch ``moe`` lands).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def build(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """A 2-layer model of ``family`` in ``dtype`` and eval mode (no dropout)."""
    import transformers

    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=16,
            vocab_size=37,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
        model_cls = transformers.GPT2LMHeadModel
    else:
        cfg_name, model_name, extra = FAMILIES[family]
        cfg = getattr(transformers, cfg_name)(**{**_COMMON, **extra})
        model_cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    with torch.no_grad():  # norms start at exactly 1 (or 0): move them off that point
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model
