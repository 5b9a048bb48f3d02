"""Mixture-of-experts capture beside a dense model, and coverage.

A small Mixtral and a dense Llama of the same *active* size (its MLP as wide as the two experts
a token runs through), from configs (random weights, CPU, float32), interleaved: a plain
training step, the same step under ``HookManager(linear_io=REGISTER_ALL)`` in each capture
style (manager built untimed), the factorized first step with the one-time coverage check, the
bytes kept per step, and the share of trainable parameters ``REGISTER_ALL`` captures.

    OMP_NUM_THREADS=1 python experiments/benchmark/moe.py [--quick] [--rounds 3]
"""

# ruff: noqa: E402  (torch is imported after the re-execution with one thread)
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env, header

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":
    ensure_env()
    sys.path.insert(0, REPO)  # this checkout's dattri_llm

import torch
import torch.nn.functional as F
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table
from utils.timing import Variant, paired_ratio, time_interleaved

from dattri_llm import REGISTER_ALL, CaptureCallback, HookManager, HookManagerConfig

SHAPES = {  # hidden, layers, heads, experts, expert width, seq, batch
    "full": dict(h=256, layers=4, heads=4, experts=8, inter=512, seq=128, batch=8),
    "quick": dict(h=64, layers=2, heads=2, experts=4, inter=128, seq=32, batch=4),
}


def build(kind: str, s: dict) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=1000, hidden_size=s["h"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                  max_position_embeddings=s["seq"])  # fmt: skip
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=s["inter"], num_experts_per_tok=2,
                                         num_local_experts=s["experts"], **common)  # fmt: skip
    else:  # dense, same active MLP width: two experts' worth
        cfg = transformers.LlamaConfig(intermediate_size=2 * s["inter"], **common)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def coverage(model: torch.nn.Module) -> float:
    """Fraction of the trainable parameters (by count) that ``REGISTER_ALL`` captures."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    captured = {id(p) for layer in hm.layer_parameters().values() for p in layer.values()}
    hm.remove()
    trainable = [p for p in model.parameters() if p.requires_grad]
    covered = sum(p.numel() for p in trainable if id(p) in captured)
    return covered / sum(p.numel() for p in trainable)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 2 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per variant")
    args = p.parse_args()
    s = SHAPES["quick" if args.quick else "full"]
    rounds = args.rounds or (2 if args.quick else 5)
    print(header("MoE capture overhead and coverage", {"shape": json.dumps(s)}))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1000, (s["batch"], s["seq"]), generator=gen)
    rows, cov_rows = [], []
    for kind in ("mixtral", "llama"):
        model = build(kind, s)
        n_params = sum(p.numel() for p in model.parameters())
        cov_rows.append([kind, f"{n_params / 1e6:.2f} M", f"{100 * coverage(model):.1f} %"])

        def plain(model=model) -> None:
            model.zero_grad(set_to_none=True)
            loss_of(model, x).backward()

        variants = [Variant("plain", plain)]
        kept: dict[str, int] = {}
        cases = [(st, st, False) for st in ("factorized", "materialized", "auto")]
        cases.append(("factorized, first step (coverage check)", "factorized", True))
        for label, style, check in cases:
            cb = CaptureCallback()
            box: dict[str, HookManager] = {}
            config = HookManagerConfig(linear_io=REGISTER_ALL, capture_style=style,
                                       check_coverage=check)  # fmt: skip

            def setup(model=model, config=config, cb=cb, box=box) -> None:
                box["hm"] = HookManager(model, config, callbacks=[cb])

            def step(model=model, box=box) -> None:
                with box["hm"].collect():
                    plain(model)

            def teardown(label=label, cb=cb, box=box, kept=kept) -> None:
                box.pop("hm").remove()
                kept[label] = cb.pop().gradient.nbytes

            variants.append(Variant(label, step, setup=setup, teardown=teardown))
        t = time_interleaved(variants, rounds, warmup=1)
        for v in variants:
            tv, base = t[v.name], t["plain"]
            ratios = [fmt_x(paired_ratio(tv, base)), fmt_x(paired_ratio(tv, base, True))]
            ratios = ["1.00x", ""] if v.name == "plain" else ratios
            rows.append([kind, v.name, fmt_s(tv.median), fmt_s(tv.cpu_median), *ratios,
                         fmt_bytes(kept.get(v.name))])  # fmt: skip
    print(md_table(["model", "trainable params", "REGISTER_ALL captures"], cov_rows) + "\n")
    heads = ["model", "step", "wall", "CPU", "wall / plain", "CPU / plain", "kept per step"]
    print(md_table(heads, rows))


if __name__ == "__main__":
    main()
