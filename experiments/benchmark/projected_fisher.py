"""Influence on projected stores: the exact projected Fisher vs unprojected K-FAC / EK-FAC.

Workload (the one of ``projection.py``): a GPT-2-shaped model from config (4 layers x 256,
sequence 64, byte vocabulary) briefly trained on Python's ``pydoc_data`` text. Its 16 block
``Conv1D`` layers are hooked (the Kronecker-eligible layers, so every method scores the same
layers). Train and test gradients are written to stores in a temporary directory:

* the reference: unprojected, factor-keeping stores (``keep_token_factors=True``), scored by
  ``KFACAttributor`` and ``EKFACAttributor``;
* ``sparse`` / ``dense`` / ``mask`` at ``proj_dim`` numbers per layer (compact stores: one
  vector per sample and layer), scored by ``KFACAttributor`` (on a vector store: the exact
  per-layer projected Fisher ``F_l = (1/N) sum_i v_il v_il^T``; EK-FAC gives the same) and, for
  context, by Grad-Dot (``TracInAttributor``) on the same store;
* ``logra`` with ``sqrt(proj_dim)`` per side, factor-keeping: K-FAC / EK-FAC in the projected
  space (LoGra); and a compact ``logra`` store (each layer its ``k x d`` projected gradient,
  no factors) scored by ``ProjectedFisherAttributor`` (each layer's exact ``k d x k d`` Fisher);
* ``sparse`` also at the ``--sweep`` sizes (default 64 and 1024 per layer), and Grad-Dot on the
  unprojected store, for context.

Every K-FAC-family score uses the default damping (0.1 x each layer's mean eigenvalue; the
vector stores also at 1 x, reusing the fit). For each
row: Spearman rank correlation per test query over the train samples (mean over queries) against
the unprojected EK-FAC and K-FAC scores, and the wall time of ``attribute_from_cache`` (fit +
score, reading the stores).

Run::

    OMP_NUM_THREADS=1 python experiments/benchmark/projected_fisher.py            # 256 / 16
    OMP_NUM_THREADS=1 python experiments/benchmark/projected_fisher.py --quick    # smaller
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from projection import block_layers, plain, spearman, workload  # noqa: E402
from utils.env import header  # noqa: E402

from dattri_llm import (  # noqa: E402
    AttributionArguments,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    OffloadCallback,
    ProjectedFisherAttributor,
    ProjectionConfig,
    TracInAttributor,
)


def write_store(model, data, path, config, bs=8, **offload) -> float:
    """Capture ``data`` into a store at ``path``; the capture's seconds."""
    off = OffloadCallback(file_manager=GradientStorageManager(path), **offload)
    hm = HookManager(model, config=config, callbacks=[off])
    with hm.collect():
        elapsed = plain(model, data, bs)  # the passes, timed (here with the hooks)
    hm.remove()
    return elapsed


def per_query(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(spearman(a[:, j], b[:, j]) for j in range(a.shape[1])) / a.shape[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="64 train / 8 test samples")
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--test", type=int, default=16)
    p.add_argument("--proj-dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--sweep", nargs="*", type=int, default=[64, 1024], help="more sparse dims")
    args = p.parse_args()
    n_train, n_test = (64, 8) if args.quick else (args.train, args.test)
    args.sweep = [] if args.quick else args.sweep
    dim = args.proj_dim
    side = int(round(dim**0.5))
    print(header("Influence on projected stores"))
    model, train_ids, test_ids, final = workload(args, n_train, n_test)
    print(
        f"model: GPT-2 {args.layers}x{args.width}, seq {args.seq}; pre-trained to loss "
        f"{final:.2f}/token; train {n_train}, test {n_test}; proj_dim {dim} per layer"
    )
    base = {"linear_io": block_layers(model, ("Conv1D",))}
    run_args = AttributionArguments(output_dir="unused", use_cpu=True, show_progress=False)

    def vector(style: str, d: int) -> tuple:
        return f"{style} {d}", HookManagerConfig(**base, projection=ProjectionConfig(style, d)), {}

    plan = [
        ("exact", HookManagerConfig(**base), {"keep_token_factors": True}),
        *(vector(style, dim) for style in ("sparse", "dense", "mask")),
        (
            f"logra {side}x{side}",
            HookManagerConfig(**base, projection=ProjectionConfig("logra", dim)),
            {"keep_token_factors": True},
        ),
        (
            f"logra {side}x{side} (compact)",
            HookManagerConfig(**base, projection=ProjectionConfig("logra", dim)),
            {},
        ),
        *(vector("sparse", d) for d in args.sweep),
    ]
    results: dict[str, tuple[torch.Tensor, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg, offload in plan:
            tr, te = os.path.join(tmp, label, "train"), os.path.join(tmp, label, "test")
            t_cap = write_store(model, train_ids, tr, cfg, **offload)
            write_store(model, test_ids, te, cfg, **offload)
            size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tr) for f in fs)
            methods = [("K-FAC", KFACAttributor(run_args)), ("EK-FAC", EKFACAttributor(run_args))]
            if label == "exact":
                methods.append(("Grad-Dot", TracInAttributor(run_args)))
            elif label.endswith("(compact)"):  # K-FAC needs the factors: the exact Fisher
                methods = [("projected Fisher", ProjectedFisherAttributor(run_args))]
            elif not label.startswith("logra"):
                fisher = KFACAttributor(run_args)
                methods = [
                    ("projected Fisher", fisher),
                    ("projected Fisher, λ = 1 x mean eig. (fit reused)", fisher),
                    ("Grad-Dot", TracInAttributor(run_args)),
                ]
            for name, att in methods:
                kw = {"damping": 1.0, "relative": True} if "λ = 1" in name else {}
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    score = att.attribute_from_cache(tr, te, **kw)
                elapsed = time.perf_counter() - t0
                key = f"{label}: {name}"
                results[key] = (score.scores, elapsed, size / n_train)
                print(f"  {key:60s} fit+score {elapsed:7.2f}s  capture {t_cap:6.2f}s", flush=True)
    ek, kf = results["exact: EK-FAC"][0], results["exact: K-FAC"][0]
    print(
        "\n| store | method | bytes / sample | fit + score (s) | Spearman per query vs EK-FAC "
        "| vs K-FAC |\n|---|---|---|---|---|---|"
    )
    for key, (scores, elapsed, nbytes) in results.items():
        store, method = key.split(": ")
        print(
            f"| {store} | {method} | {nbytes:,.0f} | {elapsed:.2f} "
            f"| {per_query(scores, ek):.3f} | {per_query(scores, kf):.3f} |"
        )


if __name__ == "__main__":
    main()
