"""LESS on LoRA adapters: warm up the adapters, capture their Adam directions, select 5 %.

LESS (Xia et al., 2024) computes its gradient features on LoRA adapters. This script runs the
paper's recipe at CI size, offline, with peft's LoRA:

1. Data: 32-token windows of Python's documentation (``pydoc_data.topics``) and of the source
   code of a few standard-library modules. The *target task* is Python code; the *training
   pool* is 90 % documentation, 10 % code. Eight held-out code windows are the validation
   queries. A tiny GPT-2 is first trained on other windows (the paper starts from a pretrained
   LM), then frozen, and peft adds rank-8 LoRA adapters to every ``c_attn``, ``c_proj`` and
   ``c_fc``.
2. Warm-up: the adapters alone trained with AdamW for a few epochs on a random 5 % of the pool;
   each epoch ends with a checkpoint (adapter weights, optimizer state, the epoch's mean
   learning rate).
3. Capture at each checkpoint, into two gradient stores: every pool window's *preconditioned*
   gradient, the Adam update direction Γ the checkpoint's optimizer state would give it
   (``HookManager(model, optimizer=opt)``), and the queries' raw gradients, both with the same
   ``sparse`` capture-time projection. Only the adapters require grad, so ``REGISTER_ALL``
   captures exactly them (the store's ``coverage`` says 100 % of the trainable parameters).
4. ``LESSAttributor.attribute_from_cache``: ``Σ_k η̄_k cos(Γ_k(z), ∇ℓ(q))`` with the learning
   rates recorded at capture; a window's score for the task is its mean over the task's
   validation queries (the paper averages within a task, then takes the max over tasks: one
   task here); the top 5 % is selected.

The script asserts what it shows for every seed: the stored capture covers 100 % of the
trainable parameters (the adapters), and LESS scored every pool window for every query. It
does not claim a good selection at this size: a 2-layer, 64-wide model trained for seconds
gives LESS little to work with. Over ``--seed 0, 1, 2`` the top 5 % held 12, 19 and 44 % code
windows against 10 % in the pool (AUC 0.58, 0.47, 0.74: the probability that a code window
outscores a documentation window); ~50-70 s per run on a shared, loaded 2-core machine. LESS's
gain on real pretrained models is measured in ``docs/benchmarks/selection.md``.

    OMP_NUM_THREADS=1 python examples/trainers/lora_less.py [--seed 0] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    LESSAttributor,
    OffloadCallback,
    hash_sample,
)
from dattri_llm.demo import build_tokenizer
from dattri_llm.gradient.ops.projection import ProjectionConfig

#: The target task's domain: Python source code (the pool is mostly documentation prose).
CODE_MODULES = ("textwrap", "string", "shlex", "fnmatch", "calendar", "difflib", "csv", "glob")
SEQ_LEN = 32


def corpus() -> list[tuple[bool, str]]:
    """``(is target, text)``: the pydoc topics (documentation prose), then the source code of
    a few standard-library modules (the target task's domain: Python code)."""
    from pydoc_data.topics import topics

    docs = [(False, " ".join(topics[name].split())) for name in sorted(topics)]
    code = [(True, inspect.getsource(importlib.import_module(m))) for m in CODE_MODULES]
    return docs + code


def token_windows(tok: object, texts: list[tuple[bool, str]]) -> list[tuple[bool, torch.Tensor]]:
    """``(is target, ids)`` for every distinct ``SEQ_LEN``-token window of every text."""
    found: dict[tuple[int, ...], bool] = {}
    for flag, text in texts:
        ids = tok.encode(text).ids  # type: ignore[attr-defined]
        for start in range(0, len(ids) - SEQ_LEN + 1, SEQ_LEN):
            found.setdefault(tuple(ids[start : start + SEQ_LEN]), flag)
    return [(flag, torch.tensor(w)) for w, flag in found.items()]


def summed_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    """Each window's mean token loss, summed over the batch: a row's gradient is its own."""
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * ids.shape[0]


def fit(
    model: nn.Module, ids: torch.Tensor, epochs: int, lr: float, seed: int, batch: int = 8
) -> list[dict]:
    """AdamW (linear decay) on the trainable parameters; one checkpoint per epoch."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    total = epochs * math.ceil(len(ids) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)
    order = torch.Generator().manual_seed(seed)
    checkpoints = []
    for _ in range(epochs):
        used = []
        for rows in torch.randperm(len(ids), generator=order).split(batch):
            opt.zero_grad(set_to_none=True)
            model(input_ids=ids[rows], labels=ids[rows]).loss.backward()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        state = opt.state_dict()
        checkpoints.append(
            {
                "weights": [p.detach().clone() for p in params],
                "optimizer": {
                    "state": {
                        i: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()
                    },
                    "param_groups": [dict(g) for g in state["param_groups"]],
                },
                "lr": sum(used) / len(used),  # LESS weighs a checkpoint by its epoch's mean lr
            }
        )
    opt.zero_grad(set_to_none=True)
    return checkpoints


def capture(
    model: nn.Module,
    ids: torch.Tensor,
    store: GradientStorageManager,
    checkpoint: int,
    projection: ProjectionConfig,
    optimizer: torch.optim.Optimizer | None = None,
) -> HookManager:
    """One pass over ``ids`` (no optimizer step) under ``checkpoint``'s label, into ``store``."""
    config = HookManagerConfig(linear_io=REGISTER_ALL, projection=projection)
    hm = HookManager(model, config, [OffloadCallback(file_manager=store)], optimizer=optimizer)
    hm.checkpoint = checkpoint
    with hm.collect(deregister_on_exit=True):
        for rows in ids.split(32):
            summed_loss(model, {"input_ids": rows}).backward()
            model.zero_grad(set_to_none=True)
    return hm


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the example; returns the selection's target share and the coverage."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pool", type=int, default=320, help="pool size (10 %% target)")
    p.add_argument("--select", type=float, default=0.05, help="fraction selected")
    p.add_argument("--warmup", type=float, default=0.05, help="fraction of the pool warmed on")
    p.add_argument("--epochs", type=int, default=4, help="warm-up epochs = checkpoints")
    p.add_argument("--batch", type=int, default=4, help="warm-up batch size")
    p.add_argument("--lr", type=float, default=2e-3, help="warm-up learning rate")
    p.add_argument("--pretrain-epochs", type=int, default=2)
    p.add_argument("--proj-dim", type=int, default=512, help="sparse projection per layer")
    p.add_argument("--queries", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="keep the two stores here (default: temporary)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    texts = corpus()
    tok = build_tokenizer([text for _, text in texts], vocab_size=1024)
    shuffled = token_windows(tok, texts)
    shuffled = [shuffled[i] for i in torch.randperm(len(shuffled), generator=gen).tolist()]
    target = [w for flag, w in shuffled if flag]
    other = [w for flag, w in shuffled if not flag]
    n_target = args.pool // 10
    queries = torch.stack(target[: args.queries])
    pool_rows = [(True, w) for w in target[args.queries : args.queries + n_target]]
    pool_rows += [(False, w) for w in other[: args.pool - n_target]]
    pool_rows = [pool_rows[i] for i in torch.randperm(len(pool_rows), generator=gen).tolist()]
    pool = torch.stack([w for _, w in pool_rows])
    is_target = torch.tensor([flag for flag, _ in pool_rows])
    rest = target[args.queries + n_target :][: n_target * 2] + other[args.pool - n_target :]
    pretrain = torch.stack(rest[: 2 * args.pool])  # unseen windows of both kinds

    # 1. a briefly pretrained base model, frozen; LoRA adapters on every attention / MLP matrix
    base = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=SEQ_LEN, vocab_size=1024,
                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                   attn_pdrop=0.0)
    )  # fmt: skip
    fit(base, pretrain, epochs=args.pretrain_epochs, lr=3e-3, seed=args.seed)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
                      target_modules=["c_attn", "c_proj", "c_fc"])  # fmt: skip
    model = get_peft_model(base, lora).eval()  # eval: no dropout; gradients still flow
    adapters = [p for p in model.parameters() if p.requires_grad]

    # 2. warm-up of the adapters on a random 5 % of the pool: checkpoints with optimizer states
    warm = torch.randperm(len(pool), generator=gen)[: max(8, round(args.warmup * len(pool)))]
    checkpoints = fit(model, pool[warm], args.epochs, args.lr, args.seed, args.batch)

    # 3. preconditioned capture of the pool, raw capture of the queries, at every checkpoint
    root = args.out or Path(tempfile.mkdtemp(prefix="lora_less_"))
    train_store = GradientStorageManager(root / "pool", mode="overwrite")
    query_store = GradientStorageManager(root / "queries", mode="overwrite")
    projection = ProjectionConfig("sparse", proj_dim=args.proj_dim, seed=args.seed)
    try:
        for k, ckpt in enumerate(checkpoints):
            with torch.no_grad():
                for p, w in zip(adapters, ckpt["weights"]):
                    p.copy_(w)
            opt = torch.optim.AdamW(adapters)
            opt.load_state_dict(ckpt["optimizer"])
            for group in opt.param_groups:
                group["lr"] = ckpt["lr"]  # recorded with each record: the checkpoint's weight
            hm = capture(model, pool, train_store, k, projection, optimizer=opt)
            capture(model, queries, query_store, k, projection)
        coverage = hm.coverage()
        t = time.perf_counter()
        less = LESSAttributor(AttributionArguments(output_dir=str(root), show_progress=False))
        score = less.attribute_from_cache(root / "pool", root / "queries")
        score_s = time.perf_counter() - t
        stored = json.loads((root / "pool" / "meta.json").read_text())["coverage"]
    finally:
        if args.out is None:
            shutil.rmtree(root)

    matrix = score.query(
        [hash_sample({"input_ids": w}) for w in pool],
        [hash_sample({"input_ids": w}) for w in queries],
    )
    k = round(args.select * len(pool))
    task_score = matrix.mean(1)
    chosen = task_score.topk(k).indices
    # how well the scores rank the whole pool: P(a target window outscores another window)
    auc = float((task_score[is_target][:, None] > task_score[~is_target][None, :]).float().mean())
    share = float(is_target[chosen].float().mean())
    chance = float(is_target.float().mean())
    print(
        f"pool: {len(pool)} windows ({int(is_target.sum())} of code), "
        f"{len(queries)} queries; LoRA adapters: {sum(p.numel() for p in adapters):,} "
        f"parameters in {len(hm.layers)} layers, base frozen; {len(checkpoints)} checkpoints; "
        f"capture covers {coverage}; stores scored in {score_s:.1f} s"
    )
    print(
        f"LESS selected {k} windows, {share:.0%} of them code (pool: {chance:.0%}); "
        f"a target window outscores another with probability {auc:.2f} (AUC):"
    )
    for i in chosen[:4].tolist():
        print(f"   [{'target' if is_target[i] else 'other'}] {tok.decode(pool[i].tolist())[:80]!r}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    assert stored["fraction"] == 1.0 and coverage.fraction == 1.0, stored
    assert matrix.shape == (len(pool), len(queries)) and bool(torch.isfinite(matrix).all())
    return {"target_share": share, "pool_share": chance, "auc": auc, "coverage": coverage.fraction}


if __name__ == "__main__":
    main()
