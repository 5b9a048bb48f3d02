"""Tiny Hugging Face GPT-2 fine-tuning: stand-in for dattri's GPT-2 / WikiText-2 setting.

Data: ``pydoc_data.topics`` (stdlib, offline) as UTF-8 byte ids; the first 60 % pre-trains the
model once (cached), the rest is split 90 / 10 into 1000 train / 100 test random 65-byte blocks.
Model: ``GPT2LMHeadModel`` (2 layers, width 64, ``Conv1D``, tied ``wte`` / ``lm_head``, batched
``position_ids``). Fine-tuning: AdamW, lr 1e-3 decayed linearly to 0, batch 8, 3 epochs, one
seeded permutation per epoch. Target: dattri's GPT-2 log-odds of the mean token probability,
as a loss (``-f``).
"""

from __future__ import annotations

import hashlib
import math
import sys
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from experiments.benchmark.quality.common import (
    CACHE_DIR,
    Setting,
    draw_blocks,
    lm_functions,
    per_sample_ce,
    seed_all,
    train_func_of,
)

BLOCK = 64
N_TRAIN, N_TEST = 1000, 100
DATA_SEED = 0
PRETRAIN_FRACTION = 0.6
MODEL: dict[str, Any] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256}
PRETRAIN: dict[str, Any] = {"steps": 1500, "batch_size": 16, "lr": 3e-3, "warmup": 50, "seed": 0}
HP: dict[str, Any] = {"epochs": 3, "batch_size": 8, "lr": 1e-3, "betas": (0.9, 0.999)}


def make_data() -> tuple[torch.Tensor, Any, Any, dict]:
    """Pre-training ids, fine-tuning train / test blocks and data facts."""
    from pydoc_data.topics import topics

    raw = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    ids = torch.tensor(list(raw), dtype=torch.long)
    cut = int(PRETRAIN_FRACTION * len(ids))
    ft_cut = cut + int(0.9 * (len(ids) - cut))
    rng = np.random.default_rng(DATA_SEED)
    train = draw_blocks(ids, cut, ft_cut, N_TRAIN, rng, BLOCK)
    test = draw_blocks(ids, ft_cut, len(ids), N_TEST, rng, BLOCK)
    facts = {"bytes": len(ids), "pretrain_region": [0, cut], "finetune_train_region": [cut, ft_cut]}
    sha = hashlib.sha256(raw).hexdigest()[:16]
    facts |= {"finetune_test_region": [ft_cut, len(ids)], "text_sha_prefix": sha}
    return ids[:cut].clone(), train, test, facts


# ---- model ---------------------------------------------------------------------------------
class TinyGPT2(nn.Module):
    """``GPT2LMHeadModel`` from config; ``forward(idx (B, T)) -> logits (B, T, vocab)``."""

    def __init__(
        self, vocab_size: int = 256, n_layer: int = 2, n_head: int = 4, n_embd: int = 64
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        sizes = {"vocab_size": vocab_size, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head}
        no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        no_special = {"bos_token_id": None, "eos_token_id": None}
        config = GPT2Config(
            n_positions=BLOCK, tie_word_embeddings=True, **sizes, **no_dropout, **no_special
        )
        config._attn_implementation = "eager"
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).expand(b, t)  # batched: per-sample gradients
        return self.gpt(input_ids=idx, position_ids=pos, use_cache=False).logits


class TinyGPT2Linear(TinyGPT2):
    """``TinyGPT2`` with every HF ``Conv1D`` an ``nn.Linear`` (kronfluence tracks those only):
    loads ``TinyGPT2`` state dicts, the ``(in, out)`` Conv1D weights transposed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers.pytorch_utils import Conv1D

        self._swapped: set[str] = set()
        for parent_name, parent in list(self.named_modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):  # the weights come with the state dict
                    setattr(parent, child_name, nn.Linear(*child.weight.shape))
                    self._swapped.add(f"{parent_name}.{child_name}".lstrip("."))
        self._register_load_state_dict_pre_hook(self._transpose_conv1d)

    def _transpose_conv1d(self, state_dict: dict, prefix: str, *_: Any) -> None:
        for name in self._swapped:
            key = f"{prefix}{name}.weight"
            if key in state_dict:
                state_dict[key] = state_dict[key].t().contiguous()


def neg_log_odds(ce: torch.Tensor) -> torch.Tensor:
    """``-f`` for dattri's target ``f = logp - log(1 - exp(logp))``, ``logp = -ce``."""
    return -(-ce - torch.log(-torch.expm1(-ce)))


# ---- training ------------------------------------------------------------------------------
def _cosine(step: int, steps: int, lr: float, warmup: int) -> float:
    if step <= warmup:
        return lr * step / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pretrain(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The pre-trained state (cached by content: data, model and hyper-parameters)."""
    key = hashlib.sha256(
        repr((MODEL, PRETRAIN, BLOCK, len(ids), ids[:4096].tolist())).encode()
    ).hexdigest()[:12]
    path = CACHE_DIR / f"gpt2-pretrain-{key}.safetensors"
    if path.exists():
        return load_file(str(path))
    seed_all(PRETRAIN["seed"])
    model = TinyGPT2(**MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=PRETRAIN["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(PRETRAIN["seed"])
    bs, steps = PRETRAIN["batch_size"], PRETRAIN["steps"]
    model.train()
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = _cosine(step, steps, PRETRAIN["lr"], PRETRAIN["warmup"])
        starts = torch.randint(0, len(ids) - BLOCK - 1, (bs,), generator=gen)
        chunk = torch.stack([ids[s : s + BLOCK + 1] for s in starts.tolist()])
        loss = per_sample_ce(model, chunk[:, :-1], chunk[:, 1:]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # tied weights share storage: store the distinct tensors only (load_state_dict re-ties)
    save_file({k: v for k, v in state.items() if k != "gpt.lm_head.weight"}, str(path))
    return load_file(str(path))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return per_sample_ce(model, x, y).mean()


def make_setting(name: str = "gpt2") -> Setting:
    """Build the ``gpt2`` setting (pre-trains once, cached)."""
    pre_ids, train, test, facts = make_data()
    pretrained = pretrain(pre_ids)
    steps_full = HP["epochs"] * math.ceil(len(train) / HP["batch_size"])
    ckpt_steps = [steps_full * q // 4 for q in (1, 2, 3, 4)]

    def lr_at(step: int, steps: int) -> float:
        return HP["lr"] * (1 - (step - 1) / steps)

    def run(loader: Any, subset: torch.Tensor, seed: int) -> tuple:
        seed_all(seed)
        model = TinyGPT2(**MODEL)
        model.load_state_dict(pretrained, strict=False)  # lm_head.weight is tied to wte
        opt = torch.optim.AdamW(model.parameters(), lr=HP["lr"], betas=HP["betas"], weight_decay=0)
        gen, bs, batches = torch.Generator().manual_seed(seed), HP["batch_size"], []
        for _epoch in range(HP["epochs"]):
            perm = subset[torch.randperm(len(subset), generator=gen)]
            batches += [perm[s : s + bs] for s in range(0, len(perm), bs)]
        return model, opt, batches, lambda step: lr_at(step, len(batches)), _loss, ckpt_steps

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=lambda: TinyGPT2(**MODEL),
        train_func=train_func_of(train, run),
        **lm_functions(neg_log_odds),
        batch_size=HP["batch_size"],
        checkpoint_epochs=ckpt_steps,
        lr=HP["lr"],
        weight_decay=0.0,
        model_spec={  # kronfluence: Conv1D swapped for nn.Linear, the tied lm_head untracked
            "module": __name__,
            "factory": "TinyGPT2Linear",
            "kwargs": dict(MODEL),
            "tracked_exclude": r"gpt\.lm_head",
            "measurement": "neg_log_odds",
        },
        checkpoint_weights=[lr_at(s, steps_full) for s in ckpt_steps],
        config={
            "data": f"pydoc_data.topics (Python {sys.version.split()[0]}), UTF-8 bytes; {facts}",
            "blocks": f"{N_TRAIN} train / {N_TEST} test non-overlapping {BLOCK}+1-byte chunks of "
            f"the fine-tuning region, numpy default_rng({DATA_SEED})",
            "model": f"transformers GPT2LMHeadModel {MODEL}, n_positions {BLOCK}, no dropout, "
            "eager attention, tied wte/lm_head, batched position_ids",
            "pretrain": f"AdamW {PRETRAIN}, random windows of the pre-training region",
            "finetune": f"AdamW {HP}, linear decay to 0, checkpoints at steps {ckpt_steps}",
            "target": "-(log-odds of the mean token probability) (dattri's GPT-2 target, as a "
            "loss)",
        },
    )
