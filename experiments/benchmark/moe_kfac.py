"""K-FAC / EK-FAC fit cost on a fused-expert MoE beside a dense model.

A small Mixtral and a dense Llama of the same *active* MLP width (two experts' worth), random
weights, float32, ``REGISTER_ALL``. The per-sample gradients of ``--batches`` training batches
are captured first (factorised, untimed); then each stage of the fit is timed once per round
(wall and process CPU time, median over rounds): the covariance sums, the eigendecomposition,
the EK-FAC eigenvalue pass and the preconditioning of one batch of queries.

Usage::

    OMP_NUM_THREADS=1 python experiments/benchmark/moe_kfac.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from utils.env import ensure_env, header  # noqa: E402
from utils.table import fmt_s, md_table  # noqa: E402

SHAPE = dict(h=128, layers=2, heads=4, experts=8, inter=256, seq=64, batch=8)


def make_model(kind: str):
    import torch
    import transformers

    base = dict(
        vocab_size=500,
        hidden_size=SHAPE["h"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["heads"],
        max_position_embeddings=SHAPE["seq"],
    )
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=2 * SHAPE["inter"], **base)
    else:
        cfg = transformers.MixtralConfig(
            intermediate_size=SHAPE["inter"],
            num_local_experts=SHAPE["experts"],
            num_experts_per_tok=2,
            **base,
        )
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def records_of(model, batches):
    import torch.nn.functional as F

    from dattri_llm import REGISTER_ALL, HookManager, HookManagerConfig
    from dattri_llm.gradient.callbacks import CaptureCallback

    cb = CaptureCallback(keep_all=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
        with hm.collect():
            for x in batches:
                logits = model(input_ids=x).logits
                F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
                ).backward()
                model.zero_grad(set_to_none=True)
    return [r.gradient for r in cb.records]


def stages(train, query) -> dict[str, tuple[float, float]]:
    from dattri_llm.gradient.kronecker import (
        KroneckerCovariances,
        eigendecompose,
        fit_eigenvalue_correction,
    )

    out, keep = {}, {}

    def timed(label, fn):
        w, c = time.perf_counter(), time.process_time()
        keep[label] = fn()
        out[label] = (time.perf_counter() - w, time.process_time() - c)

    timed("covariances", lambda: KroneckerCovariances().accumulate(train))
    timed("eigendecompose", lambda: eigendecompose(keep["covariances"], warn_skipped=False))
    timed("EK-FAC pass", lambda: fit_eigenvalue_correction(keep["eigendecompose"], train))
    timed("precondition", lambda: keep["EK-FAC pass"].precondition(query, damping=1e-3))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    args = p.parse_args()
    ensure_env()
    import torch

    torch.set_num_threads(1)
    rows = []
    for kind in ("mixtral", "llama"):
        model = make_model(kind)
        gen = torch.Generator().manual_seed(1)
        xs = [
            torch.randint(0, 500, (SHAPE["batch"], SHAPE["seq"]), generator=gen)
            for _ in range(args.batches + 1)
        ]
        grads = records_of(model, xs)
        train, query = grads[:-1], grads[-1]
        runs = [stages(train, query) for _ in range(args.rounds)]
        for label in runs[0]:
            wall = statistics.median(r[label][0] for r in runs)
            cpu = statistics.median(r[label][1] for r in runs)
            rows.append([kind, label, fmt_s(wall), fmt_s(cpu)])
    print(header("MoE K-FAC / EK-FAC fit cost", {"shape": str(SHAPE)}))
    n = args.batches * SHAPE["batch"]
    print(f"\n{n} training samples, {SHAPE['batch']} queries\n")
    print(md_table(["model", "stage", "wall", "CPU"], rows))


if __name__ == "__main__":
    main()
