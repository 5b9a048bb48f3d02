"""Targeted data selection with LESS (Xia et al., 2024): offline benchmark on real corpora.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.selection.run [--quick] [--target dialogues]

The protocol (docs/benchmarks/selection.md), per seed: warm up the pretrained base model on a
random 5 % of a pool of four corpora (:mod:`.data`; AdamW, weights and optimizer state kept at
every epoch: LESS's checkpoints); select 5 % of the pool by LESS (frozen form: Γ at every
checkpoint, ``Σ_k η̄_k cos(Γ_k(z), ∇ℓ(q; θ_k))`` with η̄_k epoch k's mean learning rate),
TracIn-Cos over the same checkpoints, Grad-Cos and EK-FAC at the last one, random, and random
from the target domain (a reference no method sees), each gradient method's per-query scores
aggregated by ``max`` over query groups (LESS) and by ``mean``; fine-tune the base model on each
selection and report the target test loss (mean ± std over seeds), the selection's share of
target-domain windows and each method's time and peak memory.

Writes experiments/benchmark/results/selection[-quick].{json,md} and prints the tables.
"""

from __future__ import annotations

from experiments.benchmark.utils.env import ensure_env

if __name__ == "__main__":
    ensure_env()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from experiments.benchmark.quality.common import CACHE_DIR, RESULTS_DIR  # noqa: E402
from experiments.benchmark.selection.data import (  # noqa: E402
    DOMAINS,
    Splits,
    chunk,
    load_texts,
    make_splits,
    tokenizer_sample,
)
from experiments.benchmark.utils.env import header  # noqa: E402
from experiments.benchmark.utils.memory import memory_method_ok, peak_rss_bytes  # noqa: E402
from experiments.benchmark.utils.models import ModelShape, batch_loss, build_model  # noqa: E402
from experiments.benchmark.utils.table import fmt_bytes, fmt_s, md_table  # noqa: E402

BLOCKS = [r"transformer\.h\.\d+\.(attn|mlp)\.c_(attn|proj|fc)"]  # the blocks' linear layers
BASE_SEED = 0  # the one base model every run starts from


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- training ----------------------------------------------------------------------------------
def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over samples of each sample's mean token loss (per-sample gradients = ∇ℓ(z))."""
    return batch_loss(model, batch["input_ids"])


def train(
    model: nn.Module,
    ids: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    keep_checkpoints: bool = False,
) -> tuple[list[dict], list[dict], list[float]]:
    """AdamW, linear warm-up (3 %) then linear decay to 0, mean loss over the batch.

    Returns the weights and optimizer state at the end of each epoch (when
    ``keep_checkpoints``) and the mean learning rate of each epoch (LESS's η̄_k).
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    per_epoch = math.ceil(len(ids) / batch_size)
    total, warm = epochs * per_epoch, max(1, round(0.03 * epochs * per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / (total - warm))
    )
    ckpts, states, epoch_lrs = [], [], []
    model.train()
    for _ in range(epochs):
        lrs = []
        perm = torch.randperm(len(ids), generator=gen)
        for i in range(0, len(ids), batch_size):
            batch = ids[perm[i : i + batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        epoch_lrs.append(sum(lrs) / len(lrs))
        if keep_checkpoints:
            ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            states.append(_clone_state(opt.state_dict()))
    opt.zero_grad(set_to_none=True)
    return ckpts, states, epoch_lrs


def _clone_state(state: dict) -> dict:
    out = {"param_groups": [dict(g) for g in state["param_groups"]], "state": {}}
    for k, s in state["state"].items():
        out["state"][k] = {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
    return out


@torch.no_grad()
def eval_loss(model: nn.Module, ids: torch.Tensor, batch_size: int = 64) -> float:
    """Mean next-token loss over ``ids`` (all windows have the same length)."""
    model.eval()
    total = 0.0
    for i in range(0, len(ids), batch_size):
        total += float(batch_loss(model, ids[i : i + batch_size]))
    model.train()
    return total / len(ids)


# ---- selection ---------------------------------------------------------------------------------
def aggregate(m: torch.Tensor, groups: Sequence[str], how: str) -> torch.Tensor:
    """Per-sample score from the ``(N, M)`` per-query scores.

    ``max``: max over validation subtasks (query groups) of the mean over the subtask's
    queries (LESS); ``mean``: mean over all queries (the influence on the mean query loss).
    """
    if how == "mean":
        return m.mean(1)
    cols = {}
    for j, g in enumerate(groups):
        cols.setdefault(g, []).append(j)
    return torch.stack([m[:, js].mean(1) for js in cols.values()], 1).amax(1)


def timed(fn: Callable[[], Any]) -> tuple[Any, dict]:
    """Run ``fn``; its result with wall time, process CPU time and peak extra memory."""
    t0, c0 = time.perf_counter(), time.process_time()
    peak, out = peak_rss_bytes(fn)
    cost = {
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "peak_bytes": peak,
    }
    return out, cost


def score_methods(
    model: nn.Module,
    ckpts: list[dict],
    states: list[dict],
    epoch_lrs: list[float],
    pool: list[dict],
    val: list[dict],
    methods: Sequence[str],
    batch_size: int,
) -> dict[str, tuple[torch.Tensor, dict]]:
    """``{method: ((N, M) scores aligned with pool x val, cost)}`` for the gradient methods."""
    from dattri_llm import (
        AttributionArguments,
        AttributionTask,
        EKFACAttributor,
        HookManagerConfig,
        LESSAttributor,
        TracInAttributor,
        hash_sample,
    )

    args = AttributionArguments(
        output_dir="unused",  # nothing is saved
        use_cpu=True,
        show_progress=False,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
    )
    hook = HookManagerConfig(linear_io=BLOCKS)
    pool_h, val_h = [hash_sample(x) for x in pool], [hash_sample(x) for x in val]
    multi = AttributionTask(loss_func=loss_sum, model=model, checkpoints=ckpts)
    last = AttributionTask(loss_func=loss_sum, model=model, checkpoints=ckpts[-1])

    def less() -> Any:
        optimizers = []  # each checkpoint's AdamW state, over the live model's parameters
        for state in states:
            optimizers.append(torch.optim.AdamW(model.parameters(), lr=epoch_lrs[0]))
            optimizers[-1].load_state_dict(state)
        attr = LESSAttributor(
            args, task=multi, optimizers=optimizers, checkpoint_weights=epoch_lrs
        )  # η̄_k: the mean learning rate of epoch k (a decayed schedule ends at 0)
        return attr.attribute(pool, val, hook)

    runs = {
        "LESS": less,
        "TracIn-Cos": lambda: TracInAttributor(
            args, task=multi, normalized_grad=True, checkpoint_weights=epoch_lrs
        ).attribute(pool, val, hook),
        "Grad-Cos": lambda: TracInAttributor(args, task=last, normalized_grad=True).attribute(
            pool, val, hook
        ),
        "EK-FAC": lambda: EKFACAttributor(args, task=last).attribute(pool, val, hook),
    }
    out = {}
    for name in methods:
        log(f"    scoring {name} ...")
        score, cost = timed(runs[name])
        out[name] = (score.query(pool_h, val_h), cost)
        log(f"    {name}: {cost['wall_s']:.1f} s, peak {cost['peak_bytes'] / 1e6:.0f} MB")
    return out


def pretrained_base(model: nn.Module, pre_ids: torch.Tensor, args: argparse.Namespace) -> dict:
    """Pretrain the base model (or load it from the cache: same windows, same settings)."""
    import hashlib

    from safetensors.torch import load_file, save_file

    key = hashlib.sha256(pre_ids.numpy().tobytes())
    key.update(repr((args.pretrain_epochs, args.pretrain_lr, args.width, args.layers,
                     BASE_SEED, torch.__version__)).encode())  # fmt: skip
    path = CACHE_DIR / "selection" / f"base-{key.hexdigest()[:16]}.safetensors"
    if path.exists():
        model.load_state_dict(load_file(str(path)))
        log(f"base model loaded from {path}")
    else:
        t0 = time.perf_counter()
        train(model, pre_ids, args.pretrain_epochs, 32, args.pretrain_lr, seed=BASE_SEED)
        log(f"base model pretrained in {time.perf_counter() - t0:.0f} s")
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(state, str(tmp))
        tmp.replace(path)  # atomic: a killed run leaves no half-written base
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the benchmark -----------------------------------------------------------------------------
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run")
    p.add_argument("--target", default="python-docs", choices=DOMAINS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", default=None, help="subset of LESS,TracIn-Cos,Grad-Cos,EK-FAC")
    for name, default in [
        ("pool-size", None),
        ("n-test", None),
        ("pretrain-windows", None),
        ("pretrain-epochs", 5),
        ("warmup-epochs", 4),
        ("finetune-epochs", 4),
    ]:
        p.add_argument(f"--{name}", type=int, default=default)  # fmt: skip
    args = p.parse_args(argv)
    q = args.quick
    args.pool_size = args.pool_size or (600 if q else 2000)
    args.n_val = 16 if q else 32
    args.n_test = args.n_test or (96 if q else 256)
    args.pretrain_windows = args.pretrain_windows or (1000 if q else 3000)
    default = "LESS,Grad-Cos,EK-FAC" if q else "LESS,TracIn-Cos,Grad-Cos,EK-FAC"
    args.methods = (args.methods or default).split(",")
    # the protocol's fixed settings (docs/benchmarks/selection.md)
    args.__dict__.update(
        domains=",".join(DOMAINS), target_share=0.1, select_frac=0.05, warmup_frac=0.05,
        lr=1e-3, pretrain_lr=5e-3, batch_size=16, seq_len=64, vocab=2048, width=128, layers=2,
        data_seed=0,
    )  # fmt: skip
    return args


def run(args: argparse.Namespace) -> dict:
    from dattri_llm.demo import build_tokenizer

    t_start = time.perf_counter()
    domains = tuple(args.domains.split(","))
    texts = load_texts(domains)
    tok = build_tokenizer(tokenizer_sample(texts), vocab_size=args.vocab)
    chunks = chunk(texts, tok, args.seq_len)
    sp: Splits = make_splits(
        chunks, args.target, args.pool_size, args.target_share, args.n_val, args.n_test,
        args.pretrain_windows, seed=args.data_seed,
    )  # fmt: skip
    pool_ids = torch.tensor([c.ids for c in sp.pool])
    val_ids = torch.tensor([c.ids for c in sp.val])
    test_ids = torch.tensor([c.ids for c in sp.test])
    pool_items = [{"input_ids": x} for x in pool_ids]
    val_items = [{"input_ids": x} for x in val_ids]
    val_groups = [c.group for c in sp.val]
    in_target = torch.tensor([c.domain == sp.target for c in sp.pool])
    k = round(args.select_frac * len(sp.pool))
    n_warm = round(args.warmup_frac * len(sp.pool))
    shape = ModelShape("gpt2", args.layers, args.width, 4, args.vocab, args.seq_len, 16)
    comp = {d: sum(c.domain == d for c in sp.pool) for d in domains}
    pre_comp = {d: sum(c.domain == d for c in sp.pretrain) for d in domains}
    log(
        f"pool {len(sp.pool)} ({comp}), {len(sp.val)} queries from {len(set(val_groups))} "
        f"groups, {len(sp.test)} test windows of {sp.target}; select {k}, warm-up on {n_warm}; "
        f"pretraining {len(sp.pretrain)} ({pre_comp})"
    )
    model = build_model(shape, BASE_SEED)
    n_params = sum(p.numel() for p in model.parameters())
    init_loss = eval_loss(model, test_ids)
    pre_ids = torch.tensor([c.ids for c in sp.pretrain])
    base_state = pretrained_base(model, pre_ids, args)
    base_loss = eval_loss(model, test_ids)
    log(f"base model: target loss {init_loss:.3f} at init, {base_loss:.3f} pretrained")

    def base() -> nn.Module:
        model = build_model(shape, BASE_SEED)
        model.load_state_dict(base_state)
        return model

    def finetune(idx: torch.Tensor, seed: int) -> float:
        model = base()
        train(model, pool_ids[idx], args.finetune_epochs, args.batch_size, args.lr, seed)
        return eval_loss(model, test_ids)

    per_seed: list[dict] = []
    for seed in range(args.seeds):
        log(f"seed {seed}: warm-up")
        gen = torch.Generator().manual_seed(1000 + seed)
        warm_idx = torch.randperm(len(sp.pool), generator=gen)[:n_warm]
        model = base()
        ckpts, states, epoch_lrs = train(
            model, pool_ids[warm_idx], args.warmup_epochs, args.batch_size, args.lr,
            seed=seed, keep_checkpoints=True,
        )  # fmt: skip
        warm_loss = eval_loss(model, test_ids)
        scores = score_methods(
            model, ckpts, states, epoch_lrs, pool_items, val_items, args.methods, 32
        )
        selections: dict[str, tuple[torch.Tensor, dict | None]] = {}
        selections["random"] = (torch.randperm(len(sp.pool), generator=gen)[:k], None)
        tgt = in_target.nonzero().flatten()
        pick = tgt[torch.randperm(len(tgt), generator=gen)[:k]]
        selections["random (target domain only)"] = (pick, None)
        for name, (m, cost) in scores.items():
            for how in ("max", "mean"):
                sel = aggregate(m, val_groups, how).topk(k).indices
                selections[f"{name} ({how})"] = (sel, cost)
        rows = {}
        for name, (idx, cost) in selections.items():
            loss = finetune(idx, seed)
            doms = {d: sum(sp.pool[i].domain == d for i in idx.tolist()) for d in domains}
            rows[name] = {
                "target_loss": loss,
                "target_share": float(in_target[idx].float().mean()),
                "domains": doms,
                "cost": cost,
                "selected": sorted(idx.tolist()),
            }
            log(f"  {name:<32} loss {loss:.4f}  target share {rows[name]['target_share']:.0%}")
        per_seed.append(
            {"seed": seed, "warmup_target_loss": warm_loss, "epoch_lrs": epoch_lrs,
             "methods": rows}
        )  # fmt: skip
    return {
        "config": {**vars(args), "params": n_params, "model": f"GPT-2 {args.layers}x{args.width}"},
        "data": {
            "pool": comp,
            "available_windows": sp.available,
            "n_val": len(sp.val),
            "val_groups": sorted(set(val_groups)),
            "n_test": len(sp.test),
            "k": k,
            "n_warmup": n_warm,
            "pretrain": pre_comp,
            "examples": {d: next(c for c in sp.pool if c.domain == d).text(tok) for d in domains},
        },
        "init_target_loss": init_loss,
        "base_target_loss": base_loss,
        "seeds": per_seed,
        "total_s": time.perf_counter() - t_start,
    }


# ---- reporting ---------------------------------------------------------------------------------
def _stats(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(xs) > 1 else 0.0


def summarize(res: dict) -> tuple[str, list[dict]]:
    seeds = res["seeds"]
    names = list(seeds[0]["methods"])
    rnd, _ = _stats([s["methods"]["random"]["target_loss"] for s in seeds])
    rows, table = [], []
    for name in names:
        loss, sd = _stats([s["methods"][name]["target_loss"] for s in seeds])
        share, share_sd = _stats([s["methods"][name]["target_share"] for s in seeds])
        costs = [s["methods"][name]["cost"] for s in seeds if s["methods"][name]["cost"]]
        wall = _stats([c["wall_s"] for c in costs])[0] if costs else None
        cpu = _stats([c["cpu_s"] for c in costs])[0] if costs else None
        peak = max(c["peak_bytes"] for c in costs) if costs else None
        beats = sum(
            s["methods"][name]["target_loss"] < s["methods"]["random"]["target_loss"] for s in seeds
        )
        rows.append(
            {"method": name, "target_loss": loss, "target_loss_std": sd, "vs_random": loss - rnd,
             "target_share": share, "target_share_std": share_sd, "wall_s": wall, "cpu_s": cpu,
             "peak_bytes": peak, "beats_random_seeds": beats}
        )  # fmt: skip
        table.append(
            [name, f"{loss:.3f} ± {sd:.3f}", "—" if name == "random" else f"{loss - rnd:+.3f}",
             f"{beats}/{len(seeds)}" if name != "random" else "—",
             f"{share:.0%} ± {share_sd:.0%}",
             "—" if wall is None else f"{fmt_s(wall)} ({fmt_s(cpu)} CPU)",
             "—" if peak is None else fmt_bytes(peak)]
        )  # fmt: skip
    heads = ["selection (aggregation)", "target test loss", "vs random", "beats random",
             "target-domain share", "selection time (wall, CPU)", "peak memory"]  # fmt: skip
    return md_table(heads, table), rows


def report(res: dict) -> str:
    """The results as Markdown: the header, the selection table and the base-model losses."""
    cfg, data = res["config"], res["data"]
    extra = {
        "pool": f"{sum(data['pool'].values())} windows of {cfg['seq_len']} tokens: "
        + ", ".join(f"{d} {n}" for d, n in data["pool"].items()),
        "target": f"{cfg['target']}: {data['n_val']} validation queries "
        f"({len(data['val_groups'])} groups), {data['n_test']} test windows",
        "model": f"{cfg['model']} from a config ({cfg['params'] / 1e6:.2f}M parameters, BPE "
        f"vocab {cfg['vocab']} trained on the corpora), hooked: the blocks' linear layers",
        "protocol": f"warm-up on {data['n_warmup']} random pool windows, {cfg['warmup_epochs']} "
        f"epochs AdamW lr {cfg['lr']} linear decay, checkpoint + optimizer state per epoch; "
        f"select {data['k']} ({cfg['select_frac']:.0%}); fine-tune the base model "
        f"{cfg['finetune_epochs']} epochs; {cfg['seeds']} seeds (warm-up subset, warm-up and "
        "fine-tune order, random selection)",
        "memory method": f"ok (100 MB probe read {memory_method_ok()[1]:.0f} MB)",
    }
    table, _ = summarize(res)
    base = res["base_target_loss"]
    warm = _stats([s["warmup_target_loss"] for s in res["seeds"]])
    lines = [
        header("Targeted data selection (LESS)", extra),
        table,
        f"Target test loss of the base model: {res['init_target_loss']:.3f} at init, "
        f"{base:.3f} after pretraining on {sum(data['pretrain'].values())} windows "
        f"({', '.join(f'{d} {n}' for d, n in data['pretrain'].items())}); of the warm-up "
        f"model: {warm[0]:.3f} ± {warm[1]:.3f}. Loss: mean next-token cross-entropy (nats) "
        "on the target test windows, mean ± std over seeds; 'beats random': seeds where the "
        f"selection's loss is below random's. Total time {res['total_s'] / 60:.1f} min.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    res = run(args)
    md = report(res)
    print(md)
    stem = "selection-quick" if args.quick else "selection"
    if args.target != "python-docs":
        stem += f"_{args.target}"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.md").write_text(md)
    _, rows = summarize(res)
    res["summary"] = rows
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(res, indent=1))
    log(f"wrote {RESULTS_DIR / stem}.{{json,md}}")
    return res


if __name__ == "__main__":
    main()
