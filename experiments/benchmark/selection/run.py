"""Targeted data selection (LESS, Xia et al., 2024) on a pool of four real corpora.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.selection.run [--quick] [--target dialogues]

Per seed: warm up the pretrained base model on a random 5 % of the pool (:mod:`.data`), keeping
weights and AdamW state at every epoch (LESS's checkpoints); select 5 % by each method, per-query
scores aggregated by the mean; fine-tune the base model on each selection and report the target
test loss, the share of target-domain picks and each method's cost. Writes
``experiments/benchmark/results/selection[-quick][_TARGET].{json,md}``.
"""

from __future__ import annotations

from experiments.benchmark.utils.env import ensure_env

if __name__ == "__main__":
    ensure_env()

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from experiments.benchmark.quality.common import RESULTS_DIR  # noqa: E402
from experiments.benchmark.selection import data as sdata  # noqa: E402
from experiments.benchmark.utils.env import header  # noqa: E402
from experiments.benchmark.utils.memory import memory_method_ok, peak_rss_bytes  # noqa: E402
from experiments.benchmark.utils.models import ModelShape, batch_loss, build_model  # noqa: E402
from experiments.benchmark.utils.table import fmt_bytes, fmt_s, md_table  # noqa: E402

BLOCKS = [r"transformer\.h\.\d+\.(attn|mlp)\.c_(attn|proj|fc)"]  # the blocks' linear layers
BASE_SEED = 0  # the one base model every run starts from
METHODS = ("LESS", "TracIn-Cos", "Grad-Cos", "EK-FAC")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over samples of each sample's mean token loss (per-sample gradients = ∇ℓ(z))."""
    return batch_loss(model, batch["input_ids"])


def train(
    model: nn.Module, ids: torch.Tensor, epochs: int, batch_size: int, lr: float, seed: int,
    keep: bool = False,
) -> tuple[list[dict], list[dict], list[float]]:  # fmt: skip
    """AdamW, linear warm-up (3 %) then linear decay to 0: the weights and optimizer state
    after each epoch (with ``keep``) and each epoch's mean learning rate (LESS's η̄_k)."""
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
            model(input_ids=batch, labels=batch).loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        epoch_lrs.append(sum(lrs) / len(lrs))
        if keep:
            ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            states.append(copy.deepcopy(opt.state_dict()))
    opt.zero_grad(set_to_none=True)
    return ckpts, states, epoch_lrs


@torch.no_grad()
def eval_loss(model: nn.Module, ids: torch.Tensor, batch_size: int = 64) -> float:
    """Mean next-token loss over ``ids`` (all windows have the same length)."""
    model.eval()
    total = sum(float(batch_loss(model, ids[i : i + batch_size]))
                for i in range(0, len(ids), batch_size))  # fmt: skip
    model.train()
    return total / len(ids)


def score_methods(
    model: nn.Module, ckpts: list[dict], states: list[dict], epoch_lrs: list[float],
    pool: list[dict], val: list[dict], methods: Sequence[str],
) -> dict[str, tuple[torch.Tensor, dict]]:  # fmt: skip
    """``{method: ((pool, queries) scores, cost)}``: wall and CPU time, peak extra memory."""
    import dattri_llm as dl

    batches = {"per_device_train_batch_size": 32, "per_device_eval_batch_size": 32}
    args = dl.AttributionArguments(
        output_dir="unused", use_cpu=True, show_progress=False, **batches
    )
    hook = dl.HookManagerConfig(linear_io=BLOCKS)
    multi = dl.AttributionTask(loss_func=loss_sum, model=model, checkpoints=ckpts)
    last = dl.AttributionTask(loss_func=loss_sum, model=model, checkpoints=ckpts[-1])

    def less() -> Any:
        optimizers = []  # each checkpoint's AdamW state, over the live model's parameters
        for state in states:
            optimizers.append(torch.optim.AdamW(model.parameters(), lr=epoch_lrs[0]))
            optimizers[-1].load_state_dict(state)
        # η̄_k: the mean learning rate of epoch k (a decayed schedule ends at 0)
        attr = dl.LESSAttributor(
            args, task=multi, optimizers=optimizers, checkpoint_weights=epoch_lrs
        )
        return attr.attribute(pool, val, hook)

    tracin = partial(dl.TracInAttributor, args, normalized_grad=True)
    runs = {
        "LESS": less,
        "TracIn-Cos": lambda: tracin(task=multi, checkpoint_weights=epoch_lrs).attribute(
            pool, val, hook
        ),
        "Grad-Cos": lambda: tracin(task=last).attribute(pool, val, hook),
        "EK-FAC": lambda: dl.EKFACAttributor(args, task=last).attribute(pool, val, hook),
    }
    pool_h, val_h = [dl.hash_sample(x) for x in pool], [dl.hash_sample(x) for x in val]
    out = {}
    for name in methods:
        log(f"    scoring {name} ...")
        t0, c0 = time.perf_counter(), time.process_time()
        peak, score = peak_rss_bytes(runs[name])
        cost = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                "peak_bytes": peak}  # fmt: skip
        out[name] = (score.query(pool_h, val_h), cost)
        log(f"    {name}: {cost['wall_s']:.1f} s, peak {peak / 1e6:.0f} MB")
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller pool, 16 queries, 3 methods")
    p.add_argument("--target", default="python-docs", choices=sdata.DOMAINS)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", help="comma-separated subset of " + ",".join(METHODS))
    sizes = {"pool-size": None, "n-test": None, "pretrain-windows": None, "pretrain-epochs": 5,
             "warmup-epochs": 4, "finetune-epochs": 4}  # fmt: skip
    for name, default in sizes.items():
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    q = args.quick
    args.pool_size = args.pool_size or (600 if q else 2000)
    args.n_val = 16 if q else 32
    args.n_test = args.n_test or (96 if q else 256)
    args.pretrain_windows = args.pretrain_windows or (1000 if q else 3000)
    args.methods = (args.methods or ("LESS,Grad-Cos,EK-FAC" if q else ",".join(METHODS))).split(",")
    # the protocol's fixed settings (docs/benchmarks/selection.md)
    args.__dict__.update(
        domains=",".join(sdata.DOMAINS), target_share=0.1, select_frac=0.05, warmup_frac=0.05,
        lr=1e-3, pretrain_lr=5e-3, batch_size=16, seq_len=64, vocab=2048, width=128, layers=2,
        data_seed=0,
    )  # fmt: skip
    return args


def run(args: argparse.Namespace) -> dict:
    from dattri_llm.demo import build_tokenizer

    t_start = time.perf_counter()
    texts = sdata.load_texts()
    tok = build_tokenizer(sdata.tokenizer_sample(texts), vocab_size=args.vocab)
    sp = sdata.make_splits(
        sdata.chunk(texts, tok, args.seq_len), args.target, args.pool_size, args.target_share,
        args.n_val, args.n_test, args.pretrain_windows, seed=args.data_seed,
    )  # fmt: skip
    pool_ids, val_ids, test_ids = (torch.tensor([c.ids for c in cs]) for cs in sp[:3])
    pool_items = [{"input_ids": x} for x in pool_ids]
    val_items = [{"input_ids": x} for x in val_ids]
    in_target = torch.tensor([c.domain == args.target for c in sp.pool])
    k, n_warm = round(args.select_frac * len(sp.pool)), round(args.warmup_frac * len(sp.pool))
    comp = {d: sum(c.domain == d for c in sp.pool) for d in sdata.DOMAINS}
    pre_comp = {d: sum(c.domain == d for c in sp.pretrain) for d in sdata.DOMAINS}
    log(f"pool {comp}, {len(sp.val)} queries, {len(sp.test)} test windows; select {k}, "
        f"warm-up on {n_warm}; pretraining {pre_comp}")  # fmt: skip
    shape = ModelShape("gpt2", args.layers, args.width, 4, args.vocab, args.seq_len, 16)
    model = build_model(shape, BASE_SEED)
    init_loss = eval_loss(model, test_ids)
    pre_ids = torch.tensor([c.ids for c in sp.pretrain])
    train(model, pre_ids, args.pretrain_epochs, 32, args.pretrain_lr, seed=BASE_SEED)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base_loss = eval_loss(model, test_ids)
    log(f"base model: target loss {init_loss:.3f} at init, {base_loss:.3f} pretrained")

    def base() -> nn.Module:
        model = build_model(shape, BASE_SEED)
        model.load_state_dict(base_state)
        return model

    per_seed: list[dict] = []
    for seed in range(args.seeds):
        log(f"seed {seed}: warm-up")
        gen = torch.Generator().manual_seed(1000 + seed)
        warm_idx = torch.randperm(len(sp.pool), generator=gen)[:n_warm]
        model = base()
        warm_ids = pool_ids[warm_idx]
        ckpts, states, epoch_lrs = train(model, warm_ids, args.warmup_epochs, args.batch_size,
                                         args.lr, seed=seed, keep=True)  # fmt: skip
        warm_loss = eval_loss(model, test_ids)
        scores = score_methods(model, ckpts, states, epoch_lrs, pool_items, val_items, args.methods)
        tgt = in_target.nonzero().flatten()
        selections = {
            "random": (torch.randperm(len(sp.pool), generator=gen)[:k], None),
            "random (target domain only)": (tgt[torch.randperm(len(tgt), generator=gen)[:k]], None),
        }
        for name, (m, cost) in scores.items():
            selections[f"{name} (mean)"] = (m.mean(1).topk(k).indices, cost)
        rows = {}
        for name, (idx, cost) in selections.items():
            model = base()
            train(model, pool_ids[idx], args.finetune_epochs, args.batch_size, args.lr, seed)
            rows[name] = {
                "target_loss": eval_loss(model, test_ids),
                "target_share": float(in_target[idx].float().mean()),
                "domains": {d: sum(sp.pool[i].domain == d for i in idx.tolist()) for d in comp},
                "cost": cost,
                "selected": sorted(idx.tolist()),
            }
            log(f"  {name:<32} loss {rows[name]['target_loss']:.4f}  "
                f"target share {rows[name]['target_share']:.0%}")  # fmt: skip
        per_seed.append({"seed": seed, "warmup_target_loss": warm_loss, "epoch_lrs": epoch_lrs,
                         "methods": rows})  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "config": {**vars(args), "params": n_params, "model": f"GPT-2 {args.layers}x{args.width}"},
        "data": dict(
            pool=comp,
            n_val=len(sp.val),
            n_test=len(sp.test),
            k=k,
            n_warmup=n_warm,
            val_groups=sorted({c.group for c in sp.val}),
            pretrain=pre_comp,
        ),
        "init_target_loss": init_loss,
        "base_target_loss": base_loss,
        "seeds": per_seed,
        "total_s": time.perf_counter() - t_start,
    }


def _stats(xs: list[float]) -> tuple[float, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(xs) > 1 else 0.0


def report(res: dict) -> str:
    """The results as Markdown: the header, the selection table and the base-model losses."""
    cfg, data, seeds = res["config"], res["data"], res["seeds"]
    rnd = [s["methods"]["random"]["target_loss"] for s in seeds]
    rnd_mean = _stats(rnd)[0]
    table = []
    for name in seeds[0]["methods"]:
        rows = [s["methods"][name] for s in seeds]
        loss, sd = _stats([r["target_loss"] for r in rows])
        share, share_sd = _stats([r["target_share"] for r in rows])
        costs = [r["cost"] for r in rows if r["cost"]]
        beats = sum(r["target_loss"] < x for r, x in zip(rows, rnd))
        wall, cpu = (_stats([c[key] for c in costs])[0] for key in ("wall_s", "cpu_s"))
        table.append(
            [name, f"{loss:.3f} ± {sd:.3f}", "—" if name == "random" else f"{loss - rnd_mean:+.3f}",
             "—" if name == "random" else f"{beats}/{len(seeds)}", f"{share:.0%} ± {share_sd:.0%}",
             f"{fmt_s(wall)} ({fmt_s(cpu)} CPU)" if costs else "—",
             fmt_bytes(max(c["peak_bytes"] for c in costs)) if costs else "—"]
        )  # fmt: skip
    heads = ("selection (aggregation)|target test loss|vs random|beats random|target-domain share"
             "|selection time (wall, CPU)|peak memory")  # fmt: skip
    extra = {
        "pool": f"{sum(data['pool'].values())} windows of {cfg['seq_len']} tokens: "
        + ", ".join(f"{d} {n}" for d, n in data["pool"].items()),
        "target": f"{cfg['target']}: {data['n_val']} validation queries "
        f"({len(data['val_groups'])} groups), {data['n_test']} test windows",
        "model": f"{cfg['model']} ({cfg['params'] / 1e6:.2f}M parameters, vocab {cfg['vocab']})",
        "protocol": f"warm-up on {data['n_warmup']} pool windows, {cfg['warmup_epochs']} epochs; "
        f"select {data['k']}; fine-tune {cfg['finetune_epochs']} epochs; {cfg['seeds']} seeds",
        "memory method": f"ok (100 MB probe read {memory_method_ok()[1]:.0f} MB)",
    }
    warm = _stats([s["warmup_target_loss"] for s in seeds])
    return "\n".join([
        header("Targeted data selection (LESS)", extra),
        md_table(heads, table),
        f"Target test loss of the base model: {res['init_target_loss']:.3f} at init, "
        f"{res['base_target_loss']:.3f} pretrained; of the warm-up model: {warm[0]:.3f} ± "
        f"{warm[1]:.3f}. Loss: mean next-token cross-entropy (nats) on the target test windows, "
        "mean ± std over seeds; 'beats random': seeds where the loss is below random's. Total "
        f"time {res['total_s'] / 60:.1f} min.",
    ])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    res = run(args)
    md = report(res)
    print(md)
    stem = ("selection-quick" if args.quick else "selection") + (
        "" if args.target == "python-docs" else f"_{args.target}"
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.md").write_text(md)
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(res, indent=1))
    log(f"wrote {RESULTS_DIR / stem}.{{json,md}}")
    return res


if __name__ == "__main__":
    main()
