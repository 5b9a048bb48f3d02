"""GPT-2 / Llama built from configs (random weights, dropout off so per-sample references are
exact, eager attention), random token batches, and the loss: the sum over samples of each
sample's mean token loss."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelShape", "FLOOR_ROWS", "floor_shape", "build_model", "make_batch", "batch_loss"]
__all__ += ["plain_fwd_bwd", "hook_config", "describe"]


@dataclass(frozen=True)
class ModelShape:
    """A model family and its sizes."""

    family: str  # "gpt2" | "llama"
    n_layer: int
    width: int
    n_head: int
    vocab: int
    seq: int
    batch: int
    intermediate: int | None = None  # llama MLP width (default 8/3 of width, rounded to 8)

    @property
    def label(self) -> str:
        return f"{self.family} {self.n_layer}x{self.width}"

    @property
    def mlp(self) -> int:
        if self.family == "gpt2":
            return 4 * self.width
        return self.intermediate or int(8 * self.width / 3 + 7) // 8 * 8


#: The floor table's rows (CPU and GPU pages): GPT-2 layers x width, train x test samples.
FLOOR_ROWS = (("4x256", 64, 16), ("4x512", 64, 16), ("6x512", 64, 16), ("4x1024", 64, 16),
              ("4x512", 256, 32), ("4x256", 1024, 64))  # fmt: skip


def floor_shape(spec: str) -> ModelShape:
    """The floor table's GPT-2 ``"LAYERSxWIDTH"``: vocab 1000, seq 64, batch 8."""
    nl, w = (int(x) for x in spec.split("x"))
    return ModelShape("gpt2", nl, w, max(2, w // 64), 1000, 64, 8)


def build_model(shape: ModelShape, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM with random weights, in training mode, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    torch.manual_seed(seed)
    common = dict(bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    if shape.family == "gpt2":
        cfg = GPT2Config(n_layer=shape.n_layer, n_embd=shape.width, n_head=shape.n_head,
                         n_positions=shape.seq, vocab_size=shape.vocab, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, **common)  # fmt: skip
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(num_hidden_layers=shape.n_layer, hidden_size=shape.width,
                          intermediate_size=shape.mlp, num_attention_heads=shape.n_head,
                          num_key_value_heads=shape.n_head, vocab_size=shape.vocab,
                          max_position_embeddings=shape.seq, pad_token_id=0, **common)  # fmt: skip
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).train()


def make_batch(shape: ModelShape, n: int | None = None, seed: int = 1) -> torch.Tensor:
    """Random token ids ``(n, seq)`` (``n`` defaults to the shape's batch)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (n or shape.batch, shape.seq), generator=gen)


def batch_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum over samples of each sample's mean next-token loss."""
    return model(input_ids=ids, labels=ids).loss * ids.shape[0]


def plain_fwd_bwd(model: nn.Module, samples: torch.Tensor, bs: int) -> None:
    """Training-style forward+backward over ``samples`` in batches of ``bs`` (weight gradients
    included): the floor that live attribution is measured against."""
    for i in range(0, len(samples), bs):
        model.zero_grad(set_to_none=True)
        batch_loss(model, samples[i : i + bs]).backward()
    model.zero_grad(set_to_none=True)


def hook_config(model: nn.Module, **kw: object) -> object:
    """``HookManagerConfig`` covering every parameter (Llama's RMSNorms via the recipe)."""
    from dattri_llm import REGISTER_ALL, HookManagerConfig
    from dattri_llm.utils.module import rms_norm_module_kwargs

    norms = {n: m for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    if not norms:
        return HookManagerConfig(linear_io=REGISTER_ALL, **kw)
    return HookManagerConfig(
        linear_io=REGISTER_ALL,
        hook_types={n: "linear_io" for n in norms},
        layer_types={n: "nn.RMSNorm" for n in norms},
        module_kwargs={
            n: rms_norm_module_kwargs(normalized_shape=m.weight.shape[0], eps=m.variance_epsilon)
            for n, m in norms.items()
        },
        **kw,
    )


def describe(shape: ModelShape, model: nn.Module) -> str:
    """One line with the shape and parameter count."""
    n = sum(p.numel() for p in model.parameters())
    extra = f", MLP {shape.mlp}" if shape.family == "llama" else ""
    return (
        f"{shape.label} ({shape.n_head} heads{extra}, vocab {shape.vocab}, seq {shape.seq}, "
        f"batch {shape.batch}; {n / 1e6:.1f}M parameters)"
    )
