"""DVEmb vs AdamW-influence: cost of scoring the same recorded run.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.trajectory_cost [--samples 1000]

One run of a small MLP (64-128-64-10, float32) on synthetic data, recorded once per optimizer
(SGD for DVEmb, AdamW for AdamW-influence): per-step per-sample gradients in a store and the
optimizer dynamics. Each attributor then scores ``--queries`` queries from the store, with its
forward sweep (every occurrence carried forward: memory and work ∝ samples) and its adjoint
sweep (the queries carried backward: ∝ queries). Prints a Markdown table: seconds and peak RSS
above the start (``experiments/benchmark/utils/memory.py``), and the largest score difference
between the two sweeps (they compute the same numbers).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

from experiments.benchmark.utils.env import header
from experiments.benchmark.utils.memory import peak_rss_bytes


def record(tmp: str, optimizer: str, n: int, epochs: int, batch: int, q: int) -> dict:
    from dattri_llm import (
        GradientStorageManager,
        HookManager,
        OffloadCallback,
        OptimizerStateCallback,
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    xq, yq = torch.randn(q, 64, generator=g), torch.randint(0, 10, (q,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
    model.append(nn.Linear(64, 10))
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    store = GradientStorageManager(f"{tmp}/{optimizer}-train", fsync=False)
    rec = OptimizerStateCallback(model, opt)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store), rec])
    loss = nn.CrossEntropyLoss(reduction="sum")
    step = 0
    with hm.collect():
        for _ in range(epochs):
            order = torch.randperm(n, generator=g)
            for i in range(0, n, batch):
                idx = order[i : i + batch]
                hm.set_sample_ids([f"s{int(j)}" for j in idx])
                opt.zero_grad()
                loss(model(x[idx]), y[idx]).backward()
                opt.step()
                rec.record_post(step)
                step += 1
    hm.remove()
    store.close()
    qstore = GradientStorageManager(f"{tmp}/{optimizer}-query", fsync=False)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=qstore)])
    with hm.collect():
        hm.set_sample_ids([f"q{j}" for j in range(q)])
        model.zero_grad()
        loss(model(xq), yq).backward()
    hm.remove()
    qstore.close()
    return {
        "train": f"{tmp}/{optimizer}-train",
        "query": f"{tmp}/{optimizer}-query",
        "dynamics": rec.dynamics(),
        "steps": step,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args()
    print(header("DVEmb vs AdamW-influence cost"))
    from dattri_llm import AdamWInfluenceAttributor, AttributionArguments, DVEmbAttributor

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args = AttributionArguments(output_dir=f"{tmp}/out", use_cpu=True, show_progress=False)
        runs = {
            o: record(tmp, o, a.samples, a.epochs, a.batch, a.queries) for o in ("sgd", "adamw")
        }
        scores = {}
        for label, opt, make in (
            ("DVEmb", "sgd", lambda m: DVEmbAttributor(args, loss_reduction="sum", method=m)),
            (
                "AdamW-influence",
                "adamw",
                lambda m: AdamWInfluenceAttributor(args, loss_reduction="sum", method=m),
            ),
        ):
            r = runs[opt]
            for method in ("forward", "adjoint"):
                att = make(method)
                t0 = time.perf_counter()
                peak, s = peak_rss_bytes(
                    lambda att=att, r=r: att.attribute_from_cache(
                        r["train"], r["query"], dynamics=r["dynamics"]
                    )
                )
                sec = time.perf_counter() - t0
                scores[(label, method)] = s.scores
                rows.append((label, method, sec, peak / 1e6, r["steps"]))
        print(f"samples {a.samples}, queries {a.queries}, epochs {a.epochs}, batch {a.batch}\n")
        print("| method | sweep | time (s) | peak RSS (MB) | steps |")
        print("|---|---|---|---|---|")
        for label, method, sec, mb, steps in rows:
            print(f"| {label} | {method} | {sec:.1f} | {mb:.0f} | {steps} |")
        for label in ("DVEmb", "AdamW-influence"):
            f, b = scores[(label, "forward")], scores[(label, "adjoint")]
            diff = float((f - b).abs().max() / b.abs().max())
            print(f"\n{label}: forward vs adjoint max |diff| / max |score| = {diff:.1e}")


if __name__ == "__main__":
    main()
