"""Write/read throughput of the gradient store vs ``torch.save`` and a raw numpy memmap.

Every method writes and reads the same records: per-sample factors ``a (B, T, D+1)`` and
``g (B, T, K)`` of GPT-2's four linear layers per transformer block (c_attn, attn c_proj, c_fc,
mlp c_proj; width 768), float32. Reads touch every element (a sum), so lazily mapped formats
pay for their page-ins. Reads follow the writes, so they are served from the page cache.

    OMP_NUM_THREADS=1 python experiments/benchmark/store_throughput.py --quick
    OMP_NUM_THREADS=1 python experiments/benchmark/store_throughput.py --offload
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import safetensors  # noqa: E402
import torch  # noqa: E402
from utils.env import header  # noqa: E402

from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord  # noqa: E402
from dattri_llm.gradient.store import GradientStorageManager  # noqa: E402

HIDDEN = 768
LAYERS = {  # name: (D without bias, K)
    "attn.c_attn": (HIDDEN, 3 * HIDDEN),
    "attn.c_proj": (HIDDEN, HIDDEN),
    "mlp.c_fc": (HIDDEN, 4 * HIDDEN),
    "mlp.c_proj": (4 * HIDDEN, HIDDEN),
}


def make_records(n: int, blocks: int, batch: int, tokens: int) -> list[GradientRecord]:
    gen = torch.Generator().manual_seed(0)
    records = []
    for step in range(n):
        layers = {}
        for blk in range(blocks):
            for name, (d, k) in LAYERS.items():
                kw = {"in_features": d, "out_features": k, "bias": True, "_k": k, "_d": d + 1}
                a = torch.randn(batch, tokens, d + 1, generator=gen)
                g = torch.randn(batch, tokens, k, generator=gen)
                layers[f"h.{blk}.{name}"] = Factorized(a, g, "transformers.Conv1D", kw)
        hashes = [f"{step}-{i}" for i in range(batch)]
        records.append(GradientRecord(step, hashes, Gradient(layers)))
    return records


def tensors_of(rec: GradientRecord) -> dict[str, torch.Tensor]:
    out = {}
    for name, lg in rec.gradient.layers.items():
        out[f"{name}.a"], out[f"{name}.g"] = lg.a, lg.g
    return out


def touch(tensors) -> float:
    return float(sum(float(t.sum()) for t in tensors))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- methods: each returns (write_seconds, read_seconds) -----------------------------------
def run_store(
    root: Path, records, *, async_write: bool, fsync: bool, verify: bool, second_pass: bool = False
):
    t0 = time.perf_counter()
    with GradientStorageManager(root, async_write=async_write, fsync=fsync) as store:
        for r in records:
            store.write(r)
    t1 = time.perf_counter()
    store = GradientStorageManager(root, verify=verify)
    for _ in range(2 if second_pass else 1):
        t1 = time.perf_counter()  # with second_pass, time the re-read (CRCs already checked)
        for block in store.iter_blocks():
            touch([t for lg in block.gradient.layers.values() for t in (lg.a, lg.g)])
    return t1 - t0 if not second_pass else float("nan"), time.perf_counter() - t1


def run_torch_save(root: Path, records, *, fsync: bool):
    root.mkdir()
    t0 = time.perf_counter()
    for r in records:
        path = root / f"{r.step}.pt"
        torch.save(tensors_of(r), path)
        if fsync:
            fsync_path(path)
    t1 = time.perf_counter()
    for r in records:
        touch(torch.load(root / f"{r.step}.pt", weights_only=True).values())
    return t1 - t0, time.perf_counter() - t1


def run_memmap(root: Path, records, *, fsync: bool):
    root.mkdir()
    layout = []
    t0 = time.perf_counter()
    for r in records:
        ts = tensors_of(r)
        total = sum(t.numel() for t in ts.values())
        path = root / f"{r.step}.bin"
        mm = np.memmap(path, dtype=np.float32, mode="w+", shape=(total,))
        off, shapes = 0, []
        for t in ts.values():
            mm[off : off + t.numel()] = t.numpy().reshape(-1)
            shapes.append((off, tuple(t.shape)))
            off += t.numel()
        mm.flush()
        del mm
        if fsync:
            fsync_path(path)
        layout.append((path, total, shapes))
    t1 = time.perf_counter()
    for path, total, shapes in layout:
        mm = np.memmap(path, dtype=np.float32, mode="c", shape=(total,))  # writable, no copy
        views = [
            torch.from_numpy(np.asarray(mm[o : o + int(np.prod(s))]).reshape(s)) for o, s in shapes
        ]
        touch(views)
        del views, mm
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 block, 6 records (~20 s)")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=None, help="transformer blocks per record")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the markdown section to this file")
    ap.add_argument(
        "--offload",
        action="store_true",
        help="also time a GPT-2 training step with OffloadCallback (needs transformers)",
    )
    args = ap.parse_args()
    n = args.records or (6 if args.quick else 12)
    blocks = args.blocks or (1 if args.quick else 2)
    repeats = 1 if args.quick else args.repeats
    records = make_records(n, blocks, args.batch, args.tokens)
    mb = sum(t.numel() * t.element_size() for r in records for t in tensors_of(r).values()) / 2**20
    versions = f"safetensors {safetensors.__version__}, numpy {np.__version__}"
    data = (
        f"{n} records x {blocks} GPT-2 block(s) x 4 linear layers (width {HIDDEN}), batch "
        f"{args.batch}, {args.tokens} tokens, float32 factors: {mb:.0f} MB in all; "
        f"best of {repeats}"
    )
    head = header("Gradient store throughput", {"versions": versions, "data": data})
    print(head, flush=True)

    methods = {
        "store (async, fsync; read with CRC check)": lambda d: run_store(
            d, records, async_write=True, fsync=True, verify=True
        ),
        "store (async, fsync; second read pass, CRC already checked)": lambda d: run_store(
            d, records, async_write=True, fsync=True, verify=True, second_pass=True
        ),
        "store (sync, no fsync; read without CRC)": lambda d: run_store(
            d, records, async_write=False, fsync=False, verify=False
        ),
        "torch.save / torch.load(weights_only=True), fsync": lambda d: run_torch_save(
            d, records, fsync=True
        ),
        "torch.save / torch.load(weights_only=True), no fsync": lambda d: run_torch_save(
            d, records, fsync=False
        ),
        "numpy memmap (raw), fsync": lambda d: run_memmap(d, records, fsync=True),
        "numpy memmap (raw), no fsync": lambda d: run_memmap(d, records, fsync=False),
    }
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="store_bench_"))
    results = {}
    try:
        for name, fn in methods.items():
            best_w = best_r = float("inf")
            for rep in range(repeats):
                d = base / f"{len(results)}_{rep}"
                w, r = fn(d)
                shutil.rmtree(d)
                best_w, best_r = min(best_w, w) if w == w else w, min(best_r, r)
            results[name] = (mb / best_w, mb / best_r)
            print(
                f"{name:55s} write {mb / best_w:8.0f} MB/s  read {mb / best_r:8.0f} MB/s",
                flush=True,
            )
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    ref_w, ref_r = results["torch.save / torch.load(weights_only=True), fsync"]
    mm_w, mm_r = results["numpy memmap (raw), fsync"]
    lines = [
        head.rstrip("\n"),
        "- machine: shared 2-core VM, timings taken under load from other work (1-min load "
        f"average {os.getloadavg()[0]:.1f} at the end); reads follow the writes and are served "
        "from the page cache",
        "",
        "| method | write MB/s | read MB/s | write vs torch.save | read vs torch.load | "
        "write vs memmap | read vs memmap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def fmt(x: float, suffix: str = "") -> str:
        return "—" if x != x else (f"{x:.2f}{suffix}" if suffix else f"{x:.0f}")

    for name, (w, r) in results.items():
        lines.append(
            f"| {name} | {fmt(w)} | {fmt(r)} | {fmt(w / ref_w, 'x')} | {fmt(r / ref_r, 'x')} | "
            f"{fmt(w / mm_w, 'x')} | {fmt(r / mm_r, 'x')} |"
        )
    if args.offload:
        # the offload benchmark's own measurement, on a GPT-2 4 x 256 (vocab 1000, seq 64, b 8)
        from offload_overhead import bench as offload_bench
        from utils.models import ModelShape

        shape = ModelShape("gpt2", 4, 256, 4, 1000, 64, 8)
        lines += ["", offload_bench(shape, 4, 2 if args.quick else 4, tempfile.gettempdir())]
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
