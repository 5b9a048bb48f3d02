"""Bytes per sample of a ``logra`` projected store: factors kept vs compact vs bf16 / fp16.

The workload: GPT-2 2 x 128 built from ``GPT2Config`` (vocab 256), seq 256,
``logra`` 16 x 16 (``proj_dim=256``) on the attention and MLP ``Conv1D`` layers of every block.
Writes the same capture to stores with ``keep_token_factors=True`` (the layout before compact
storage), the defaults, and ``storage_dtype="bfloat16"`` / ``"float16"``; reports the bytes per
sample on disk and per layer, and the rank agreement (Spearman per query) of TracIn scores
from the bf16 / fp16 stores with the float32 ones.

    OMP_NUM_THREADS=1 python experiments/benchmark/store_compact.py [--train 64 --test 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utils.env import header  # noqa: E402

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    ProjectionConfig,
    TracInAttributor,
)


def make_model(seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=128,
        n_head=4,
        n_positions=seq,
        vocab_size=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg).eval()


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def write(
    model: nn.Module, ids: torch.Tensor, path: Path, batch: int, project: bool = True, **offload
) -> int:
    """Capture ``ids`` into a store at ``path``; returns the bytes of its shards."""
    hooked = [
        n
        for n, m in model.named_modules()
        if n.startswith("transformer.h.") and type(m).__name__ == "Conv1D"
    ]
    proj = ProjectionConfig("logra", proj_dim=256, seed=0) if project else None
    cfg = HookManagerConfig(linear_io=hooked, projection=proj)
    fm = GradientStorageManager(path, fsync=False)
    hm = HookManager(model, cfg, callbacks=[OffloadCallback(file_manager=fm, **offload)])
    with hm.collect():
        for i in range(0, len(ids), batch):
            model.zero_grad(set_to_none=True)
            lm_loss(model, ids[i : i + batch]).backward()
    hm.remove()
    fm.close()
    return sum(r.path.stat().st_size for r in GradientStorageManager(path).records())


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=64)
    p.add_argument("--test", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--unprojected", type=int, default=16, help="samples of the unprojected pair")
    args = p.parse_args()
    print(header("Compact gradient stores"))
    model = make_model(args.seq)
    g = torch.Generator().manual_seed(0)
    train = torch.randint(0, 256, (args.train, args.seq), generator=g)
    test = torch.randint(0, 256, (args.test, args.seq), generator=g)
    variants = {
        "factors kept (keep_token_factors=True; the old default)": {"keep_token_factors": True},
        "compact (default)": {},
        "compact, storage_dtype='bfloat16'": {"storage_dtype": "bfloat16"},
        "compact, storage_dtype='float16'": {"storage_dtype": "float16"},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows, dirs = [], {}
        for i, (label, kw) in enumerate(variants.items()):
            tr, te = root / f"train{i}", root / f"test{i}"
            size = write(model, train, tr, args.batch, **kw)
            write(model, test, te, args.batch, **kw)
            rows.append((label, size / args.train))
            dirs[label] = (tr, te)
        print(
            f"GPT-2 2x128 (GPT2Config, vocab 256), seq {args.seq}, logra 16x16 on the 8 "
            f"attention + MLP Conv1D layers, {args.train} train samples (batch {args.batch})\n"
        )
        print("| store | KiB / sample on disk | vs factors kept |")
        print("|---|---:|---:|")
        for label, b in rows:
            print(f"| {label} | {b / 1024:.1f} | {b / rows[0][1]:.3f}x |")
        n = args.unprojected
        unproj = [
            write(model, train[:n], root / f"unproj{i}", args.batch, False, **kw)
            for i, kw in enumerate(({"keep_token_factors": True}, {}))
        ]
        print(f"\nunprojected, same layers ({n} samples):\n")
        print("| store | KiB / sample on disk | vs factors kept |")
        print("|---|---:|---:|")
        for label, b in zip(list(variants)[:2], unproj):
            print(f"| {label} | {b / n / 1024:.1f} | {b / unproj[0]:.3f}x |")
        store = GradientStorageManager(dirs["compact (default)"][0])
        (block, *_) = store.iter_blocks()
        print("\nper layer (first record): kind in the compact store")
        for name, lg in block.gradient.layers.items():
            print(f"  {name}: {type(lg).__name__} {tuple(lg.materialize().data.shape[1:])}")
        targs = AttributionArguments(output_dir=str(root / "out"), use_cpu=True)
        targs.show_progress = False
        scores = {
            label: TracInAttributor(targs).attribute_from_cache(*dirs[label]).scores
            for label in list(variants)[1:]
        }
        ref = scores["compact (default)"]
        print("\n| storage dtype | Spearman per query vs float32: min / mean | max rel. error |")
        print("|---|---:|---:|")
        for label in list(variants)[2:]:
            rho = [spearman(scores[label][:, q], ref[:, q]) for q in range(ref.shape[1])]
            err = float((scores[label] - ref).abs().max() / ref.abs().max())
            print(f"| {label} | {min(rho):.4f} / {sum(rho) / len(rho):.4f} | {err:.2e} |")


if __name__ == "__main__":
    main()
