"""Routing benchmark: the cost model's choice vs each route pinned for every layer.

Two parts, both CPU, one thread:

1. **Single linear layer sweep.** For a few ``(D, K)`` and token counts ``S``, the time of a
   train x test Gram (``ops.cross_dot``, ``B1 x B2`` samples) and of per-sample squared norms
   (``ops.grad_norm_sq``) with the route pinned to ``factorized`` and to ``materialized``, and
   the cost model's pick. "auto / best" is the time of the picked route over the faster one.
2. **Whole models.** Capture a train batch and a test batch factorized from a GPT-2 / Llama
   model, then time ``ops.cross_dot`` under ``pin_route("factorized")``,
   ``pin_route("materialized")`` and the cost model (``auto``), per layer and in total, and the
   oracle (the faster route of every layer). All routes must agree (max rel. difference shown).

Usage::

    python experiments/benchmark/routing.py --quick
    python experiments/benchmark/routing.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from utils.adapters.run_ours import HookedStep, pin_route  # noqa: E402
from utils.env import header  # noqa: E402
from utils.models import ModelShape, batch_loss, build_model, hook_config, make_batch  # noqa: E402
from utils.table import fmt_s, fmt_x, md_table  # noqa: E402
from utils.timing import Variant, time_interleaved  # noqa: E402

from dattri_llm.gradient import Factorized, Gradient, ops  # noqa: E402

ROUTES = ("factorized", "materialized")


def log(msg: str) -> None:
    print(f"[routing] {msg}", file=sys.stderr, flush=True)


def median_time(fn: object, rounds: int) -> float:
    return time_interleaved([Variant("x", fn)], rounds=rounds, warmup=1)["x"].median


def capture_linear(d: int, k: int, b: int, s: int, seed: int) -> Gradient:
    """Capture a ``Linear(d, k)`` on a random ``(b, s, d)`` input (factorized)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(d, k))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d, generator=gen)
    step = HookedStep(
        layer, lambda m, inp: m(inp).pow(2).sum(), hook_config(layer, capture_style="factorized")
    )
    step.setup()
    rec = step(x)
    step.teardown()
    return rec.gradient


def layer_sweep(quick: bool, rounds: int) -> str:
    b1, b2 = 8, 8
    dims = [(256, 256), (256, 1024)] if quick else [(512, 512), (512, 2048), (256, 8192)]
    seqs = [4, 32, 256] if quick else [4, 16, 64, 256, 1024]
    rows = []
    for d, k in dims:
        for s in seqs:
            if not quick and k * s > 4_000_000:
                continue  # keeps the sweep short and the factors small
            x = capture_linear(d, k, b1, s, 1)
            y = capture_linear(d, k, b2, s, 2)
            fx = next(iter(x.layers.values()))
            assert isinstance(fx, Factorized)
            rule, kw = fx.rule, fx.module_kwargs
            for op in ("cross_dot", "grad_norm_sq"):
                if op == "cross_dot":
                    pick = rule.prefer_materialized_gram(b1, b2, s, s, kw)
                    t = {
                        r: median_time(lambda r=r, x=x, y=y: ops.cross_dot(x, y, mode=r), rounds)
                        for r in ROUTES
                    }
                else:
                    pick = rule.prefer_materialized_norm(s, kw)
                    t = {
                        r: median_time(lambda r=r, x=x: ops.grad_norm_sq(x, mode=r), rounds)
                        for r in ROUTES
                    }
                chosen = "materialized" if pick else "factorized"
                best = min(t, key=t.get)
                rows.append(
                    [
                        f"{d}->{k}",
                        s,
                        op,
                        fmt_s(t["factorized"]),
                        fmt_s(t["materialized"]),
                        chosen,
                        best,
                        fmt_x(t[chosen] / t[best]),
                    ]
                )
            log(f"layer {d}->{k} S={s} done")
    return md_table(
        [
            "Linear D->K",
            "S",
            "op",
            "factorized",
            "materialized",
            "cost model picks",
            "faster",
            "auto / best",
        ],
        rows,
    )


def auto_route(x_lg: object, y_lg: object) -> str:
    """The route ``mode='auto'`` takes for one layer pair (simple layers only)."""
    if isinstance(x_lg, Factorized) and isinstance(y_lg, Factorized):
        pick = x_lg.rule.prefer_materialized_gram(
            x_lg.batch_size, y_lg.batch_size, x_lg.num_tokens, y_lg.num_tokens, x_lg.module_kwargs
        )
        return "materialized" if pick else "factorized"
    return "mixed (tied sites)" if type(x_lg).__name__ == "Shared" else "materialized"


def model_routing(shape: ModelShape, b_test: int, rounds: int) -> str:
    model = build_model(shape)
    step = HookedStep(model, batch_loss, hook_config(model, capture_style="factorized"))
    step.setup()
    x = step(make_batch(shape, seed=1)).gradient
    y = step(make_batch(shape, n=b_test, seed=2)).gradient
    step.teardown()
    model.zero_grad(set_to_none=True)
    per_layer = []
    totals = {"factorized": 0.0, "materialized": 0.0, "auto": 0.0, "oracle": 0.0}
    agree = 0
    for name in x.layer_names:
        xl, yl = x.select_layers([name]), y.select_layers([name])
        t = {
            r: median_time(lambda r=r, xl=xl, yl=yl: ops.cross_dot(xl, yl, mode=r), rounds)
            for r in ROUTES
        }
        t["auto"] = median_time(lambda xl=xl, yl=yl: ops.cross_dot(xl, yl, mode="auto"), rounds)
        route = auto_route(x.layers[name], y.layers[name])
        best = min(ROUTES, key=t.get)
        agree += route == best or t["auto"] <= 1.1 * t[best]
        for r in ("factorized", "materialized", "auto"):
            totals[r] += t[r]
        totals["oracle"] += t[best]
        per_layer.append((name, x.layers[name].layer_type, t, route, best))
    # whole Gram under each pinned route (pin_route patches the predicates everywhere)
    whole, results = {}, {}
    for r in ("factorized", "materialized", "auto"):
        with pin_route(r):
            whole[r] = median_time(lambda: ops.cross_dot(x, y), rounds)
            results[r] = ops.cross_dot(x, y)
    ref = results["auto"].double()
    diff = max(float((results[r].double() - ref).abs().max() / ref.abs().max()) for r in ROUTES)
    out = [
        f"### {shape.label}, vocab {shape.vocab}, seq {shape.seq}: train {shape.batch} x "
        f"test {b_test} Gram\n"
    ]
    out.append(
        md_table(
            ["route", "whole cross_dot (pin_route)", "sum of per-layer times", "vs auto"],
            [
                [r, fmt_s(whole[r]), fmt_s(totals[r]), fmt_x(totals[r] / totals["auto"])]
                for r in ("factorized", "materialized", "auto")
            ]
            + [
                [
                    "oracle (faster per layer)",
                    "",
                    fmt_s(totals["oracle"]),
                    fmt_x(totals["oracle"] / totals["auto"]),
                ]
            ],
        )
    )
    out.append(
        f"\nCost model agrees with the faster route (or is within 10% of it) on {agree} of "
        f"{len(per_layer)} layers; the three routes agree to {diff:.1e} (max rel.).\n"
    )
    # the layers where the choice matters most
    per_layer.sort(key=lambda e: -abs(e[2]["factorized"] - e[2]["materialized"]))
    rows = [
        [n, lt, fmt_s(t["factorized"]), fmt_s(t["materialized"]), fmt_s(t["auto"]), route, best]
        for n, lt, t, route, best in per_layer[:8]
    ]
    out.append("\nLayers with the largest gap between routes:\n")
    out.append(
        md_table(
            ["layer", "type", "factorized", "materialized", "auto", "auto takes", "faster"], rows
        )
    )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="gpt2,llama", help="whole models: comma list of families")
    args = p.parse_args()
    print(
        header(
            "Routing benchmark: cost model vs pinned routes",
            {
                "timing": f"median of {args.rounds} calls after 1 warm-up",
            },
        )
    )
    print("### One linear layer, train 8 x test 8 (cross_dot) and per-sample norms of 8\n")
    print(layer_sweep(args.quick, args.rounds), flush=True)
    if args.quick:
        models = [
            (ModelShape("gpt2", 2, 128, 4, 4096, 32, 8), 8),
            (ModelShape("gpt2", 2, 128, 4, 4096, 256, 8), 8),
            (ModelShape("llama", 2, 128, 4, 4096, 64, 8), 8),
        ]
    else:
        models = [
            (ModelShape("gpt2", 4, 256, 4, 50257, 32, 8), 8),
            (ModelShape("gpt2", 4, 256, 4, 50257, 256, 8), 8),
            (ModelShape("llama", 4, 256, 4, 32000, 128, 8, intermediate=688), 8),
        ]
    for shape, b_test in models:
        if shape.family not in args.models.split(","):
            continue
        print(model_routing(shape, b_test, args.rounds), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
