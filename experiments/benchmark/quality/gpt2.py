"""Tiny Hugging Face GPT-2 fine-tuning: stand-in for dattri's GPT-2 / WikiText-2 benchmark.

Data: Python's own documentation, ``pydoc_data.topics`` (stdlib, always offline; 79 topics,
465k characters), byte-level token ids (UTF-8 bytes, vocabulary 256: no tokenizer download,
no training randomness). The topics are joined in sorted-key order; the first 60 % of the text
is the **pre-training** region, the rest the **fine-tuning** region, split nanoGPT-style (first
90 % train, last 10 % test). Non-overlapping 65-byte chunks of each fine-tuning part are drawn
with a fixed seed (``x = chunk[:64]``, ``y = chunk[1:]``).

Model: ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (2 layers, width 64,
4 heads, 64 positions, no dropout, eager attention): the real ``Conv1D`` projections and the
tied ``wte`` / ``lm_head`` (dattri_llm captures both sites of the shared matrix). The wrapper
passes a *batched* ``position_ids`` so ``wpe`` has true per-sample gradients.

Stages (as dattri's script fine-tunes a pre-trained ``gpt2``):

* **pre-training** once, on random 64-byte windows of the pre-training region (AdamW, cosine
  schedule), cached as safetensors next to the ground truth;
* **fine-tuning** of that checkpoint on a (subset of the) train blocks: AdamW (lr 1e-3, no
  weight decay), linear decay to 0, batch 8, 3 epochs over the subset (dattri: 3 epochs,
  lr 5e-5 for the 124M model). The batch order is the only randomness: one permutation per
  epoch from a ``torch.Generator`` seeded with dattri's per-run seed.

Target: as dattri's GPT-2 scripts, the log-odds of the mean token probability,
``f = logp - log(1 - exp(logp))`` with ``logp = -mean token CE``. The harness's ``target`` is a
*loss* (dattri's ``calculate_lds_ground_truth`` flips its sign), so it returns ``-f``, and the
test side of every attributor differentiates ``-f`` (``∇(-f) = ∇CE / (1 - p)``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.func import functional_call

from experiments.benchmark.quality.common import (
    CACHE_DIR,
    Setting,
    TrainObserver,
    TupleDataset,
    seed_all,
)

BLOCK = 64
N_TRAIN, N_TEST = 1000, 100
DATA_SEED = 0
PRETRAIN_FRACTION = 0.6
MODEL: dict[str, Any] = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256}
PRETRAIN: dict[str, Any] = {"steps": 1500, "batch_size": 16, "lr": 3e-3, "warmup": 50, "seed": 0}
HP: dict[str, Any] = {"epochs": 3, "batch_size": 8, "lr": 1e-3, "betas": (0.9, 0.999)}


# ---- data ----------------------------------------------------------------------------------
def corpus() -> bytes:
    """``pydoc_data.topics`` joined in sorted-key order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def make_data() -> tuple[torch.Tensor, TupleDataset, TupleDataset, dict]:
    """Pre-training ids, fine-tuning train / test blocks and data facts."""
    raw = corpus()
    ids = torch.tensor(list(raw), dtype=torch.long)
    cut = int(PRETRAIN_FRACTION * len(ids))
    ft_cut = cut + int(0.9 * (len(ids) - cut))
    rng = np.random.default_rng(DATA_SEED)

    def draw(lo: int, hi: int, n: int) -> torch.Tensor:
        starts = np.arange(lo, hi - BLOCK - 1, BLOCK + 1)
        pick = np.sort(rng.choice(starts, n, replace=False))
        return torch.stack([ids[s : s + BLOCK + 1] for s in pick.tolist()])

    train, test = draw(cut, ft_cut, N_TRAIN), draw(ft_cut, len(ids), N_TEST)
    facts = {
        "bytes": len(ids),
        "pretrain_region": [0, cut],
        "finetune_train_region": [cut, ft_cut],
        "finetune_test_region": [ft_cut, len(ids)],
        "text_sha_prefix": hashlib.sha256(raw).hexdigest()[:16],
    }
    return (
        ids[:cut].clone(),
        TupleDataset(train[:, :-1].clone(), train[:, 1:].clone()),
        TupleDataset(test[:, :-1].clone(), test[:, 1:].clone()),
        facts,
    )


# ---- model ---------------------------------------------------------------------------------
class TinyGPT2(nn.Module):
    """``GPT2LMHeadModel`` from config; ``forward(idx (B, T)) -> logits (B, T, vocab)``."""

    def __init__(
        self, vocab_size: int = 256, n_layer: int = 2, n_head: int = 4, n_embd: int = 64
    ) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=vocab_size,
            n_positions=BLOCK,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,
        )
        config._attn_implementation = "eager"
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        pos = torch.arange(t, device=idx.device).expand(b, t)  # batched: per-sample gradients
        return self.gpt(input_ids=idx, position_ids=pos, use_cache=False).logits


class TinyGPT2Linear(TinyGPT2):
    """``TinyGPT2`` with every HF ``Conv1D`` swapped for the equivalent ``nn.Linear``.

    For kronfluence, which tracks ``nn.Linear`` / ``nn.Conv2d`` only (its own GPT-2 example
    swaps ``Conv1D`` the same way). Same function; loads ``TinyGPT2`` state dicts (the
    ``(in, out)`` Conv1D weights are transposed on load).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers.pytorch_utils import Conv1D

        self._swapped: set[str] = set()
        for parent_name, parent in list(self.named_modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, Conv1D):
                    d_in, d_out = child.weight.shape
                    linear = nn.Linear(d_in, d_out)
                    with torch.no_grad():
                        linear.weight.copy_(child.weight.t())
                        linear.bias.copy_(child.bias)
                    setattr(parent, child_name, linear)
                    self._swapped.add(f"{parent_name}.{child_name}".lstrip("."))
        self._register_load_state_dict_pre_hook(self._transpose_conv1d)

    def _transpose_conv1d(self, state_dict: dict, prefix: str, *_: Any) -> None:
        for name in self._swapped:
            key = f"{prefix}{name}.weight"
            if key in state_dict:
                state_dict[key] = state_dict[key].t().contiguous()


def per_sample_ce(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) mean next-token cross-entropy per block."""
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)


def neg_log_odds(ce: torch.Tensor) -> torch.Tensor:
    """``-f`` for dattri's target ``f = logp - log(1 - exp(logp))``, ``logp = -ce``."""
    return -(-ce - torch.log(-torch.expm1(-ce)))


# ---- training ------------------------------------------------------------------------------
def _cosine(step: int, steps: int, lr: float, warmup: int) -> float:
    if step <= warmup:
        return lr * step / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pretrain(make_model: Any, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The pre-trained state (cached by content: data, model and hyper-parameters)."""
    key = hashlib.sha256(
        repr((MODEL, PRETRAIN, BLOCK, len(ids), ids[:4096].tolist())).encode()
    ).hexdigest()[:12]
    path = CACHE_DIR / f"gpt2-pretrain-{key}.safetensors"
    if path.exists():
        return load_file(str(path))
    seed_all(PRETRAIN["seed"])
    model = make_model()
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


def _members(dataloader: Any, n_full: int) -> torch.Tensor:
    ds = dataloader.dataset
    if isinstance(ds, torch.utils.data.Subset):
        return torch.as_tensor(sorted(int(i) for i in ds.indices), dtype=torch.long)
    if len(ds) != n_full:
        raise ValueError(f"gpt2 train_func: expected the train set or a Subset, got {ds!r}")
    return torch.arange(n_full)


def make_setting(name: str = "gpt2") -> Setting:
    """Build the ``gpt2`` setting (pre-trains once, cached)."""
    pre_ids, train, test, facts = make_data()

    def make_model() -> nn.Module:
        return TinyGPT2(**MODEL)

    pretrained = pretrain(make_model, pre_ids)
    steps_full = HP["epochs"] * math.ceil(len(train) / HP["batch_size"])
    ckpt_steps = [steps_full * q // 4 for q in (1, 2, 3, 4)]

    def lr_at(step: int, steps: int) -> float:
        return HP["lr"] * (1 - (step - 1) / steps)

    def train_func(
        dataloader: Any,
        seed: int | None = None,
        return_checkpoints: bool = False,
        mask_index: int | None = None,
        observer: TrainObserver | None = None,
        **_: Any,
    ) -> Any:
        """dattri's train contract: fine-tune the pre-trained model on the loader's samples.

        ``mask_index`` (trajectory-specific LOO): that train block is dropped from every batch
        it falls in (the batch's mean loss is taken over the others); the batch order, the
        step count and the learning-rate schedule stay those of the unmasked run.
        ``observer`` watches the loop (the trajectory methods record the reference run with it).
        """
        seed = 0 if seed is None else int(seed)
        members = _members(dataloader, len(train))
        if mask_index is not None and not bool((members == int(mask_index)).any()):
            raise ValueError(f"mask_index={mask_index} is not a member of the training subset.")
        seed_all(seed)
        model = make_model()
        model.load_state_dict(pretrained, strict=False)  # lm_head.weight is tied to wte
        opt = torch.optim.AdamW(model.parameters(), lr=HP["lr"], betas=HP["betas"], weight_decay=0)
        gen = torch.Generator().manual_seed(seed)
        bs = HP["batch_size"]
        steps = HP["epochs"] * math.ceil(len(members) / bs)
        ckpts, step = [], 0
        observer = observer or TrainObserver()
        model.train()
        with observer.run(model, opt):
            for _epoch in range(HP["epochs"]):
                perm = members[torch.randperm(len(members), generator=gen)]
                for s in range(0, len(perm), bs):
                    step += 1
                    idx = perm[s : s + bs]
                    if mask_index is not None:
                        idx = idx[idx != int(mask_index)]
                    for group in opt.param_groups:
                        group["lr"] = lr_at(step, steps)
                    if len(idx) == 0:
                        continue
                    x, y = train.x[idx], train.y[idx]
                    observer.before_backward(step - 1, idx, {"x": x, "y": y})
                    loss = per_sample_ce(model, x, y).mean()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    observer.after_step(step - 1)
                    if return_checkpoints and step in ckpt_steps:
                        ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        model.eval()
        return (model, ckpts) if return_checkpoints else model

    def target(model: nn.Module, dataloader: Any) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            out = [neg_log_odds(per_sample_ce(model, x, y)) for x, y in dataloader]
        return torch.cat(out).detach().to(torch.float64)

    def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
        return per_sample_ce(model, batch["x"], batch["y"]).sum()

    def target_sum(model: nn.Module, batch: dict) -> torch.Tensor:
        return neg_log_odds(per_sample_ce(model, batch["x"], batch["y"])).sum()

    def _single(model: nn.Module, log_odds: bool) -> Any:
        def fn(params: dict, data: Any) -> torch.Tensor:
            x, y = data
            if x.dim() == 1:
                x, y = x[None], y[None]
            ce = per_sample_ce(lambda i: functional_call(model, params, (i,)), x, y)
            return (neg_log_odds(ce) if log_odds else ce).mean()

        return fn

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=make_model,
        train_func=train_func,
        target=target,
        loss_sum=loss_sum,
        make_loss_single=lambda model: _single(model, False),
        batch_size=HP["batch_size"],
        checkpoint_epochs=ckpt_steps,
        lr=HP["lr"],
        weight_decay=0.0,
        model_spec={  # kronfluence: Conv1D swapped for nn.Linear, the tied lm_head untracked
            "module": "experiments.benchmark.quality.gpt2",
            "factory": "TinyGPT2Linear",
            "kwargs": dict(MODEL),
            "tracked_exclude": r"gpt\.lm_head",
            "measurement": "neg_log_odds",
        },
        task_kind="lm",
        checkpoint_weights=[lr_at(s, steps_full) for s in ckpt_steps],
        target_sum=target_sum,
        make_target_single=lambda model: _single(model, True),
        trajectory="adamw",
        config={
            "data": f"pydoc_data.topics (Python {__import__('sys').version.split()[0]}), "
            f"UTF-8 bytes; {facts}",
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
