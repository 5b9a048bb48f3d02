"""Bytes the Kronecker statistics add to a compact store (``OffloadCallback`` defaults).

Tiny GPT-2 models built from ``GPT2Config`` (vocab 50257, tied LM head, seq 128, batch 8) are
captured into a default store, every layer hooked (the whole model) or only the blocks'
``Conv1D`` layers (the worst case: every hooked layer dense, no embedding factors); reported
are the store's bytes without the statistics file (what a compact store held before), the
file's bytes and their ratio. The file is per partition and checkpoint, not per sample, so the
ratio falls as the samples per checkpoint grow.

    OMP_NUM_THREADS=1 python experiments/benchmark/kronecker_statistics_size.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utils.env import header  # noqa: E402

from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback

CASES = [  # (what is hooked, n_embd, samples)
    ("whole model", 64, 16),
    ("whole model", 64, 64),
    ("whole model", 128, 64),
    ("blocks only", 64, 16),
    ("blocks only", 64, 64),
    ("blocks only", 64, 256),
]


def measure(hooked: str, n_embd: int, samples: int, seq: int = 128, batch: int = 8) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_positions=seq, n_embd=n_embd, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(cfg).train()
    config = HookManagerConfig()
    if hooked == "blocks only":
        config = HookManagerConfig(linear_io=[r"transformer\.h\.\d+\.(attn|mlp)\.c_\w+"])
    with tempfile.TemporaryDirectory() as tmp:
        store = GradientStorageManager(tmp)
        hm = HookManager(model, config, callbacks=[OffloadCallback(file_manager=store)])
        g = torch.Generator().manual_seed(1)
        with hm.collect():
            for _ in range(0, samples, batch):
                ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
        hm.remove()
        store.close()
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp) for f in fs)
        stats = os.path.getsize(os.path.join(tmp, "kronecker_statistics.safetensors"))
    before = total - stats
    return (
        f"| {hooked} | {n_embd} | {samples} | {before / 1e6:.2f} | {stats / 1e6:.3f} | "
        f"{total / before:.4f}x |"
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="16 samples only")
    quick = p.parse_args().quick
    print(header("Kronecker statistics of a compact store"))
    print("| hooked | n_embd | samples | store without (MB) | statistics (MB) | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in [c for c in CASES if c[1:] == (64, 16)] if quick else CASES:
        print(measure(*case), flush=True)
