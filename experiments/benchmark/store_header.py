"""Bytes per sample of a gradient store at small batches: the per-record header's share.

Two workloads, each written as its capture writes it:

* the 134M-Llama shape (``LlamaConfig`` like SmolLM-135M: hidden 576, 30 layers, 9 / 3 heads,
  intermediate 1536, vocab 49152, tied embeddings) built from its config, random tokens, seq 512,
  ``dattri-llm capture``'s hook config with its default projection; one batch of 8 is
  captured and written as records of 1 and of 8 samples (``GradientStorageManager.write``, as
  ``dattri-llm capture`` does), with write and read timings;
* the 1M benchmark's store (``million.py``): GPT-2 2 x 64 from config, seq 16, ``sparse`` 256 on
  the 8 attention / MLP ``Conv1D`` layers, ``OffloadCallback`` (compact), batch 512.

Reports shard bytes and store bytes (every file of the directory) per sample beside the
projected numbers' bytes.

    OMP_NUM_THREADS=1 python experiments/benchmark/store_header.py [--records 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.store import GradientStorageManager


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (hidden lock files included; they are empty)."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def shard_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*.safetensors"))


def llama_block(batch: int, seq: int) -> tuple[object, list[str], dict]:
    """One captured batch of the 134M-Llama shape: ``(gradient, hashes, metadata)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dattri_llm.gradient.causal_lm import (
        DEFAULT_PROJECTION,
        hook_config,
        pad_batch,
        parse_projection,
        summed_loss,
    )
    from dattri_llm.gradient.streaming import GradientStreamer

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(cfg).eval()
    config = hook_config(None, parse_projection(DEFAULT_PROJECTION), model)
    items = []
    for _ in range(batch):
        ids = torch.randint(0, cfg.vocab_size, (seq,))
        items.append({"input_ids": ids, "labels": ids.clone()})

    class Items(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from items

    streamer = GradientStreamer(
        model, Items(), summed_loss, hook_config=config, batch_size=batch,
        collate_fn=pad_batch(0),
    )  # fmt: skip
    block = next(iter(streamer))
    meta = {**dict(block.metadata), "loss_reduction": "sum"}
    return block.gradient, list(block.hashes), meta


def payload_per_sample(gradient) -> int:
    total = 0
    for lg in gradient.layers.values():
        for leaf in getattr(lg, "sites", [lg]):
            ts = [leaf.data] if hasattr(leaf, "data") else [leaf.a, leaf.g]
            total += sum(t.numel() * t.element_size() for t in ts)
    return total // gradient.batch_size


def write_llama(root: Path, gradient, hashes, meta, batch: int, records: int) -> dict:
    """Write ``records`` records of ``batch`` rows (rows of the captured batch, new hashes)."""
    n = gradient.batch_size
    store = GradientStorageManager(root)
    t0 = time.perf_counter()
    for r in range(records):
        rows = [(r * batch + i) % n for i in range(batch)]
        g = gradient.slice(rows).clone()
        ids = [f"{h[:-8]}{r * batch + i:08x}" for i, h in enumerate(hashes[j] for j in rows)]
        store.write(GradientRecord(r, ids, g, 0, meta))
    store.close()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    reader = GradientStorageManager(root)
    rows_read = sum(b.gradient.batch_size for b in reader.iter_blocks())
    read_s = time.perf_counter() - t0
    samples = batch * records
    assert rows_read == samples
    return {
        "shard": shard_bytes(root) / samples,
        "store": dir_bytes(root) / samples,
        "write_s": write_s,
        "read_s": read_s,
        "samples": samples,
        "mb": dir_bytes(root) / 1e6,
    }


def million_store(root: Path, batches: int, batch: int = 512) -> dict:
    """The 1M benchmark's store layout: ``(store bytes / sample, payload / sample)``."""
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    from dattri_llm import HookManager, HookManagerConfig, OffloadCallback, ProjectionConfig

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=16, vocab_size=50257)
    model = GPT2LMHeadModel(cfg).eval()
    config = HookManagerConfig(
        linear_io=[r"transformer\.h\.\d+\.(attn|mlp)\.c_.*"],
        projection=ProjectionConfig("sparse", 256, seed=0),
        capture_style="auto",
    )
    store = GradientStorageManager(root, fsync=False)
    hm = HookManager(model, config=config, callbacks=[OffloadCallback(file_manager=store)])
    with hm.collect():
        for _ in range(batches):
            ids = torch.randint(0, cfg.vocab_size, (batch, 16))
            logits = model(input_ids=ids).logits[:, :-1]
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            model.zero_grad(set_to_none=True)
            loss.backward()
    hm.remove()
    store.close()
    n = batches * batch
    return {"store": dir_bytes(root) / n, "shard": shard_bytes(root) / n, "payload": 8 * 256 * 4}


def round_trip(records: int = 16, reps: int = 3) -> tuple[float, float]:
    """Best-of-``reps`` write (async, fsync) and read (CRC checked) seconds of ``records``
    batch-1 records shaped like the Llama capture (272 layers of 1024 numbers), synthetic."""
    import hashlib

    from dattri_llm.gradient.gradient import Gradient, Materialized

    kw = {"_k": 1, "_d": 1024, "proj_dim": 1024, "seed": 0, "source_layer_type": "nn.Linear",
          "source_module_kwargs": {"in_features": 576, "out_features": 576, "bias": False},
          "nnz": 1}  # fmt: skip
    recs = []
    for step in range(records):
        g = Gradient(
            {f"model.layers.{i}.q": Materialized(torch.randn(1, 1024), "projected.sparse", kw)
             for i in range(272)}
        )  # fmt: skip
        recs.append(GradientRecord(step, [hashlib.sha256(b"%d" % step).hexdigest()], g, 0))
    best_w = best_r = float("inf")
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            store = GradientStorageManager(d)
            for r in recs:
                store.write(r)
            store.close()
            best_w = min(best_w, time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert sum(1 for _ in GradientStorageManager(d).iter_blocks()) == records
            best_r = min(best_r, time.perf_counter() - t0)
    return best_w, best_r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=8, help="records per store")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--million-batches", type=int, default=4)
    ap.add_argument("--timing-only", action="store_true", help="only the synthetic round trip")
    a = ap.parse_args()
    if a.timing_only:
        w, r = round_trip()
        print(f"16 batch-1 records of 272 x 1024 float32: write {w:.3f} s, read {r:.3f} s")
        return
    t0 = time.perf_counter()
    gradient, hashes, meta = llama_block(8, a.seq)
    print(f"captured 8 x {a.seq} tokens in {time.perf_counter() - t0:.1f} s; "
          f"{len(gradient.layers)} layers")  # fmt: skip
    payload = payload_per_sample(gradient)
    print(f"134M-Llama shape, seq {a.seq}: projected numbers {payload} bytes per sample")
    print("| batch | shard bytes / sample | store bytes / sample | vs numbers (store) "
          "| write MB/s | read MB/s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for batch in (1, 8):
            r = write_llama(Path(tmp) / f"b{batch}", gradient, hashes, meta, batch, a.records)
            print(
                f"| {batch} | {r['shard']:,.0f} | {r['store']:,.0f} | {r['store'] / payload:.3f}x"
                f" | {r['mb'] / r['write_s']:.0f} | {r['mb'] / r['read_s']:.0f} |"
            )
        m = million_store(Path(tmp) / "million", a.million_batches)
        print(
            f"1M benchmark layout (GPT-2 2x64, sparse 8 x 256, compact, batch 512, "
            f"{a.million_batches} records): store {m['store']:,.1f} bytes / sample, shards "
            f"{m['shard']:,.1f}, numbers {m['payload']}"
        )
    print(f"threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")


if __name__ == "__main__":
    main()
