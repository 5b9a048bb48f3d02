"""A tour of every attribution method, on one real task, live and from a gradient store.

A tiny GPT-2 (from a config) is trained with full-batch AdamW on paragraphs of eight Python
documentation topics (``pydoc_data.topics``, shipped with Python; corpus and tokenizer from
``dattri_llm.demo``). At three training steps the model state is kept as a state dict and a
``HookManager`` + ``OffloadCallback`` writes that step's per-sample gradients to a store (the
training loop is untouched). Held-out paragraphs of the same topics are the queries.

Every method then runs live (``attribute``: gradients streamed from the model) and from the
stores (``attribute_from_cache``; one train and one query store hold all three checkpoints,
``checkpoints=[last]`` selects the last one for the one-checkpoint methods; no model, no
backward): Grad-Dot, Grad-Cos, TracIn over the three checkpoints, K-FAC and EK-FAC (default
and an explicit damping; the cached runs fit the Kronecker factors from the store), and a live
Grad-Dot on gradients projected at capture time. The trajectory methods: LESS (the train side
captured preconditioned, ``HookManager(optimizer=opt)``, at the three checkpoints; live in its
frozen form with the optimizer state of each checkpoint), AdamW-influence (every step of the run
recorded on a 256-coordinate random mask per layer with ``OptimizerStateCallback``; queries at
the final weights) and DVEmb (live: it trains a copy with SGD for one epoch while recording).
One line per run: the share of each query's
top-5 proponents from the query's own topic (chance: about 1/8), the wall time, the Spearman
correlation with EK-FAC's scores and, for cached runs, the relative difference to the live run
(asserted < 1e-5 for Grad-Dot).

    OMP_NUM_THREADS=1 python examples/attribution/method_tour.py [--steps 60] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from collections.abc import Sequence

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    AttributionTask,
    DVEmbAttributor,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    LESSAttributor,
    LiveRunArguments,
    OffloadCallback,
    OptimizerStateCallback,
    ProjectionConfig,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.demo import build_tokenizer, load_corpus

BLOCKS = [r"transformer\.h\.\d+\.(attn|mlp)\.c_(attn|proj|fc)"]  # the blocks' linear layers


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Summed token loss (padding masked): each sample's gradient is its own, any batch size."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1]
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == 0, -100)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman correlation of two score matrices, per query column, averaged."""
    rx, ry = (m.argsort(0).argsort(0).double() for m in (x, y))
    rx, ry = rx - rx.mean(0), ry - ry.mean(0)
    return float(((rx * ry).sum(0) / (rx.norm(dim=0) * ry.norm(dim=0))).mean())


def backward(model: nn.Module, items: list[torch.Tensor], batch_size: int = 32) -> None:
    """One pass of (accumulating) backward calls over ``items``: an ordinary training loop."""
    for i in range(0, len(items), batch_size):
        loss_fn(model, {"input_ids": torch.stack(items[i : i + batch_size])}).backward()


def capture(
    model: nn.Module,
    items: list[torch.Tensor],
    save_dir: str,
    checkpoint: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """The same pass with hooks on: per-sample gradients go to a store, labelled ``checkpoint``
    (mode="append": each checkpoint adds its records to the same store); with ``optimizer``,
    preconditioned (LESS's Γ)."""
    store = GradientStorageManager(save_dir, mode="append")
    hm = HookManager(
        model,
        config=HookManagerConfig(linear_io=BLOCKS),
        # keep the factors (the larger store): K-FAC / EK-FAC could also fit from the sums a
        # compact store records, but the factors serve every method of the tour alike
        callbacks=[
            OffloadCallback(offload_interval=1, file_manager=store, keep_token_factors=True)
        ],
        optimizer=optimizer,
    )
    hm.checkpoint = checkpoint  # pairs train and test gradients of the same model state
    with hm.collect(deregister_on_exit=True):
        backward(model, items)
    store.close()


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the tour; returns ``{(method, workflow): (topic share, seconds, spearman)}``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-topic", type=int, default=12, help="train paragraphs per topic")
    p.add_argument("--queries-per-topic", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=60, help="full-batch AdamW steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--damping", type=float, default=1e-3, help="the explicit (absolute) damping")
    p.add_argument("--proj-dim", type=int, default=256)
    p.add_argument(
        "--mask-dim", type=int, default=256, help="AdamW-influence / DVEmb mask per layer"
    )
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="stores and scores (default: a temp dir, removed at exit)"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dattri_llm_tour_") as tmp:
        out = args.out or tmp
        kept = "" if args.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"stores and scores go to {out}{kept}")
        return tour(args, out)


def tour(args: argparse.Namespace, out: str) -> dict:
    """The tour itself; stores and scores are written under ``out``."""
    torch.manual_seed(args.seed)

    corpus = load_corpus()  # (topic, paragraph) pairs
    tok = build_tokenizer([t for _, t in corpus], vocab_size=1024)  # "<pad>" is id 0
    gen = torch.Generator().manual_seed(args.seed)
    train, queries, seen = [], [], set()
    for topic in dict.fromkeys(t for t, _ in corpus):
        paras = [x for t, x in corpus if t == topic]
        n_q = args.queries_per_topic
        for n, i in enumerate(torch.randperm(len(paras), generator=gen)[: n_q + args.per_topic]):
            ids = tok.encode(paras[i]).ids[: args.seq_len]
            ids = torch.tensor(ids + [0] * (args.seq_len - len(ids)))
            if tuple(ids.tolist()) not in seen:  # samples are identified by content
                seen.add(tuple(ids.tolist()))
                (queries if n < n_q else train).append((topic, ids))
    train_items = [{"input_ids": ids} for _, ids in train]
    query_items = [{"input_ids": ids} for _, ids in queries]
    train_h, query_h = map(lambda xs: [hash_sample(x) for x in xs], (train_items, query_items))

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=args.seq_len, vocab_size=1024,
                   bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ckpt_steps = [args.steps // 3, 2 * args.steps // 3, args.steps - 1]
    ckpts, opt_states, t0 = [], [], time.perf_counter()
    train_ids = [ids for _, ids in train]
    # the whole run, every step, on a random mask of each layer: what AdamW-influence reads
    masked = HookManagerConfig(
        linear_io=BLOCKS, projection=ProjectionConfig("mask", proj_dim=args.mask_dim, seed=1)
    )
    micro = -(-len(train_ids) // 32)  # backward() accumulates batches of 32 into one update
    recorder = OptimizerStateCallback(model, opt, gradient_accumulation_steps=micro)
    run_store = GradientStorageManager(f"{out}/run")
    offload = OffloadCallback(file_manager=run_store, gradient_accumulation_steps=micro)
    run = HookManager(model, masked, [offload, recorder])
    with run.collect(deregister_on_exit=True):
        for step in range(args.steps):  # full-batch AdamW; 3 steps also offload their gradients
            opt.zero_grad(set_to_none=True)
            if step in ckpt_steps:
                c = len(ckpts)
                ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                opt_states.append(copy.deepcopy(opt.state_dict()))
                with run.paused():  # extra passes of the same step: not part of the run
                    capture(model, train_ids, f"{out}/less", c, optimizer=opt)
                    opt.zero_grad(set_to_none=True)
                capture(model, train_ids, f"{out}/train", c)
            else:
                backward(model, train_ids)
            opt.step()
            recorder.record_post(step)
    run_store.close()
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for c, state in enumerate(ckpts):  # the queries' gradients at each checkpoint
        model.load_state_dict(state)
        capture(model, [ids for _, ids in queries], f"{out}/query", c)
    model.load_state_dict(final)  # and at the final weights, on the run's mask
    query_store = GradientStorageManager(f"{out}/query_final")
    hm = HookManager(model, masked, [OffloadCallback(file_manager=query_store)])
    with hm.collect(deregister_on_exit=True):
        backward(model, [ids for _, ids in queries])
    query_store.close()
    model.zero_grad(set_to_none=True)
    topics, last = [t for t, _ in train], len(ckpts) - 1  # one-checkpoint methods: the last
    print(
        f"{len(train)} train / {len(queries)} query paragraphs of {len(set(topics))} topics; "
        f"GPT-2 2x64, {args.steps} steps, checkpoints at steps {ckpt_steps} "
        f"({time.perf_counter() - t0:.1f} s)"
    )

    a = AttributionArguments(output_dir=f"{out}/scores", use_cpu=True, show_progress=False)
    single = AttributionTask(loss_func=loss_fn, model=model, checkpoints=ckpts[last])
    multi = AttributionTask(loss_func=loss_fn, model=model, checkpoints=ckpts)
    hook = HookManagerConfig(linear_io=BLOCKS)
    proj = HookManagerConfig(
        linear_io=BLOCKS, projection=ProjectionConfig("logra", proj_dim=args.proj_dim, seed=0)
    )
    weights = [args.lr] * len(ckpts)  # TracIn's w_c: the learning rate at each checkpoint
    optimizers = []  # LESS's frozen form: each checkpoint's optimizer state, on the live model
    for state in opt_states:
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=args.lr))
        optimizers[-1].load_state_dict(state)
    at_final = AttributionTask(loss_func=loss_fn, model=model, checkpoints=final)
    # the SGD copy's learning rate: under the summed token loss 0.01 diverges (NaN by its 6th
    # step, which the sweep refuses), 1e-3 stays finite
    sgd_args = AttributionArguments(
        output_dir=f"{out}/scores", show_progress=False, per_device_train_batch_size=16
    )
    sgd = LiveRunArguments(optimizer="sgd", learning_rate=1e-3, lr_scheduler_type="constant")
    tr, te, at_last = f"{out}/train", f"{out}/query", {"checkpoints": [last]}
    kfac, ekfac = KFACAttributor(a, task=single), EKFACAttributor(a, task=single)
    kfac_c, ekfac_c = KFACAttributor(a), EKFACAttributor(a)
    lam = args.damping

    def gd(task=single, **kw):  # Grad-Dot / Grad-Cos / TracIn, live or from the stores
        return TracInAttributor(a, task, **kw)

    runs = [  # (method, workflow, run); "cache" rows are compared with the "live" row
        ("EK-FAC", "live", lambda: ekfac.attribute(train_items, query_items, hook)),
        ("Grad-Dot", "live", lambda: gd().attribute(train_items, query_items, hook)),
        ("Grad-Dot", "cache", lambda: gd(None).attribute_from_cache(tr, te, **at_last)),
        ("Grad-Cos", "live", lambda: gd(normalized_grad=True).attribute(
            train_items, query_items, hook)),
        ("Grad-Cos", "cache", lambda: gd(None, normalized_grad=True).attribute_from_cache(
            tr, te, **at_last)),
        (f"TracIn x{len(ckpts)}", "live", lambda: gd(multi, checkpoint_weights=weights).attribute(
            train_items, query_items, hook)),
        (f"TracIn x{len(ckpts)}", "cache", lambda: gd(None, checkpoint_weights=weights)
            .attribute_from_cache(tr, te)),  # every checkpoint of the stores, paired
        ("K-FAC", "live", lambda: kfac.attribute(train_items, query_items, hook)),
        ("K-FAC", "cache", lambda: kfac_c.attribute_from_cache(tr, te, **at_last)),
        (f"K-FAC l={lam:g}", "live", lambda: kfac.attribute(
            train_items, query_items, hook, damping=lam)),
        (f"K-FAC l={lam:g}", "cache", lambda: kfac_c.attribute_from_cache(
            tr, te, damping=lam, **at_last)),
        ("EK-FAC", "cache", lambda: ekfac_c.attribute_from_cache(tr, te, **at_last)),
        (f"EK-FAC l={lam:g}", "live", lambda: ekfac.attribute(
            train_items, query_items, hook, damping=lam)),
        (f"EK-FAC l={lam:g}", "cache", lambda: ekfac_c.attribute_from_cache(
            tr, te, damping=lam, **at_last)),
        (f"Grad-Dot logra {args.proj_dim}", "live", lambda: gd().attribute(
            train_items, query_items, proj)),
        (f"LESS x{len(ckpts)}", "live", lambda: LESSAttributor(
            a, task=multi, optimizers=optimizers).attribute(train_items, query_items, hook)),
        (f"LESS x{len(ckpts)}", "cache", lambda: LESSAttributor(a).attribute_from_cache(
            f"{out}/less", te)),  # weights: the learning rates recorded at capture
        ("AdamW-influence", "cache", lambda: AdamWInfluenceAttributor(
            a, loss_reduction="sum").attribute_from_cache(
            f"{out}/run", f"{out}/query_final", dynamics=recorder.dynamics())),
        ("DVEmb (SGD copy)", "live", lambda: DVEmbAttributor(
            sgd_args, task=at_final, live_run=sgd).attribute(train_items, query_items, masked)),
    ]  # fmt: skip
    print(f"\n{'method':<20}{'workflow':<9}{'top-' + str(args.top_k) + ' topic':>12}"
          f"{'time':>8}{'rho(EK-FAC)':>13}{'vs live':>10}")  # fmt: skip
    scores, summary = {}, {}
    for name, flow, run in runs:
        t = time.perf_counter()
        m = run().query(train_h, query_h)  # (train, query), aligned by content hash
        dt = time.perf_counter() - t
        scores[name, flow] = m
        top = m.topk(args.top_k, dim=0).indices  # (k, queries)
        share = sum(topics[i] == q for j, (q, _) in enumerate(queries) for i in top[:, j].tolist())
        share /= top.numel()
        rho = spearman(m, scores["EK-FAC", "live"])
        err = None
        if flow == "cache" and (name, "live") in scores:
            live = scores[name, "live"]
            err = float((m - live).abs().max() / live.abs().max())
            exact = name == "Grad-Dot" or name.startswith("LESS")
            assert not exact or err < 1e-5, f"live and cached {name} differ: {err:.2e}"
        summary[name, flow] = (share, dt, rho)
        print(f"{name:<20}{flow:<9}{share:>12.0%}{dt:>7.2f}s{rho:>13.3f}"
              f"{'' if err is None else f'{err:.1e}':>10}")  # fmt: skip
    chance = sum(topics.count(q) for q, _ in queries) / (len(queries) * len(topics))
    print(f"chance level of the topic share: {chance:.0%}; Kronecker fits reused across dampings")
    return summary


if __name__ == "__main__":
    main()
