"""The 1M-sample run: capture, store, exact ``top_k`` and FAISS search.

A tiny GPT-2 (2 layers, width 64, vocab 1024, trained briefly; ``million_data.py``) over
>= 1,000,000 distinct real-text windows of ``--seq`` tokens, every phase in its own process (so
each phase's peak resident memory, ``VmHWM``, is its own), one thread, in one invocation:

1. ``capture`` (per projection style and storage dtype): a plain training step (no hooks) on the
   first ``--plain`` windows, then ``HookManager`` + ``OffloadCallback`` over the windows with
   ``ProjectionConfig("sparse", 256)`` or ``ProjectionConfig("logra", 256)`` (16 x 16) on the 8
   attention / MLP linear layers: 2048 numbers per sample; then the 100 query windows into a
   test store. samples/s, ratio to the plain step, bytes per sample, store size.
2. ``score``: ``TracInAttributor.attribute_from_cache(train, test, top_k=10)`` (exact).
3. ``limit``: the same vectors read back (``GradientStorageManager.load_record``) into an
   ``(N, 2048)`` float32 file (the FAISS phase's input); the exact matmul + top-k of the 100
   queries over them timed on 64k-row blocks already in memory (summed: the in-memory matmul
   limit), a sequential read of the store's files (page cache), the exact dot / cosine top-10s.
4. ``faiss``: IVF-Flat (nprobe sweep) and IVF-PQ + exact re-ranking of a short list from the
   memory-mapped vectors, built in 64k-row chunks, one process per job (dot checked vs 2.).
5. ``gindex``: the public ``GradientIndex.build / open / search`` (flat, ivf, hnsw) on the
   ``logra`` store (``--logra-n`` samples): build time, size, ``search()`` per query, recall;
   plan step 8 runs it on the full ``sparse`` store (``--only 8 --gindex-kinds ivf``: IVF-PQ
   with its re-rank file, an ``nprobe`` x ``rerank`` sweep, recall@10 vs the exact top-10 of
   step 2's ``limit`` phase).

    OMP_NUM_THREADS=1 python experiments/benchmark/million.py --n 1000000  # --until: a time cap

Stores go to ``--data`` (default ``/work/wt/_data/bench1m``, outside the repository); results to
``experiments/benchmark/results/million_<N><tag>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# this checkout's dattri_llm, not whichever one is installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from utils.env import BENCH_DIR, ensure_env  # noqa: E402
from utils.memory import status_bytes  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS = r"transformer\.h\.\d+\.(attn|mlp)\.c_.*"
BLOCK = 65536
K = 10


def log(msg: str) -> None:
    print(f"[million {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss() -> int:
    return status_bytes("VmHWM")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(path) for f in fs)


def batches(windows: np.ndarray, n: int, bs: int):
    for i in range(0, n, bs):
        yield torch.from_numpy(windows[i : min(n, i + bs)].astype(np.int64))


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss * ids.shape[0]  # sum of per-sample means


# ----------------------------------------------------------------------------------- phases
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

    def plain(m: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for ids in batches(windows, m, a.batch):
            model.zero_grad(set_to_none=True)
            loss_of(model, ids).backward()
        return m / (time.perf_counter() - t0), m / (time.process_time() - c0)

    if not a.test_only:
        plain(a.batch)  # warm-up
        plain_before = plain(min(a.plain, n))
    config = HookManagerConfig(
        linear_io=[LAYERS],
        projection=ProjectionConfig(a.style, 256, seed=0),
        capture_style="auto",
    )

    def capture(root: str, data: np.ndarray, m: int) -> tuple[float, float, int]:
        shutil.rmtree(root, ignore_errors=True)
        store = GradientStorageManager(root, fsync=False)
        cb = OffloadCallback(file_manager=store, storage_dtype=a.dtype)
        hm = HookManager(model, config=config, callbacks=[cb])
        t0, c0 = time.perf_counter(), time.process_time()
        with hm.collect():
            done = 0
            for i, ids in enumerate(batches(data, m, a.batch)):
                model.zero_grad(set_to_none=True)
                loss_of(model, ids).backward()
                done += ids.shape[0]
                if i % 200 == 0 and m > 50_000:
                    log(f"  {a.style}/{a.dtype}: {done} / {m}")
                if a.until and time.time() > a.until:
                    log(f"  stopping at {done} samples: --capture-until reached")
                    break
        hm.remove()
        store.close()
        return time.perf_counter() - t0, time.process_time() - c0, done

    if a.test_only:  # only the query store (for a store captured earlier)
        capture(a.store + "_test", queries, len(queries))
        return {"test_only": True}
    wall, cpu, n = capture(a.store, windows, n)
    plain_after = plain(min(a.plain, n))
    a.until = None
    capture(a.store + "_test", queries, len(queries))
    size = dir_bytes(a.store)
    plain_wall = 2 / (1 / plain_before[0] + 1 / plain_after[0])
    plain_cpu = 2 / (1 / plain_before[1] + 1 / plain_after[1])
    return {"style": a.style, "dtype": a.dtype, "n": n, "numbers_per_sample": 8 * 256,
            "capture_s": wall, "capture_cpu_s": cpu, "capture_sps": n / wall,
            "capture_sps_cpu": n / cpu, "plain_sps_before_after": [plain_before[0], plain_after[0]],
            "plain_sps_cpu_before_after": [plain_before[1], plain_after[1]],
            "ratio_to_plain": plain_wall / (n / wall), "ratio_to_plain_cpu": plain_cpu / (n / cpu),
            "store_bytes": size, "bytes_per_sample": size / n,
            "payload_bytes_per_sample": 8 * 256 * (4 if a.dtype == "float32" else 2)}  # fmt: skip


def _child(a, phase: str, **extra: object) -> subprocess.Popen:
    """The same script in a fresh process for ``phase`` (stdout: its JSON line)."""
    argv = [sys.executable, os.path.abspath(__file__), *_flags(a, {"phase": phase, **extra})]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def _collect(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        return {"failed": proc.returncode}
    return json.loads(out.strip().splitlines()[-1])


def phase_score(a) -> dict:
    """Exact ``top_k`` (both paths); ``limit`` runs beside it (independent, read-only)."""
    from dattri_llm import AttributionArguments, TracInAttributor

    done = os.path.join(a.scratch, "limit_result.json")
    if os.path.exists(done):
        os.unlink(done)
    limit = _child(a, "limit", beside=True) if not a.sequential else None
    args = AttributionArguments(output_dir=a.scratch, use_cpu=True, show_progress=False)
    from dattri_llm.attribution.engine import vector_scan  # the fast path; both are measured

    vector_scan.ENABLED = False
    t0, c0 = time.perf_counter(), time.process_time()
    g = TracInAttributor(args).attribute_from_cache(a.store, a.store + "_test", top_k=K)
    general = (time.perf_counter() - t0, time.process_time() - c0, g.top_k(K))
    vector_scan.ENABLED = True
    t0, c0 = time.perf_counter(), time.process_time()
    s = TracInAttributor(args).attribute_from_cache(a.store, a.store + "_test", top_k=K)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    top = s.top_k(K)
    with open(os.path.join(a.scratch, "score_topk.json"), "w") as f:
        json.dump({"test": top.test_hashes, "proponents": top.proponent_hashes}, f)
    out = {"score_s": wall, "score_cpu_s": cpu, "score_sps": s.num_train / wall,
           "score_sps_cpu": s.num_train / cpu, "n": s.num_train, "queries": s.num_test,
           "fast_path": True}  # fmt: skip
    out["general_path"] = {
        "score_s": general[0], "score_cpu_s": general[1],
        "score_sps": s.num_train / general[0], "score_sps_cpu": s.num_train / general[1],
        "same_top10": general[2].proponent_hashes == top.proponent_hashes,
    }  # fmt: skip
    if limit is not None:
        res = {**_collect(limit), "ran_beside_score": True}
        if "failed" not in res:
            with open(os.path.join(a.scratch, "limit_result.json"), "w") as f:
                json.dump(res, f)
    return out


def _read_files(root: str, chunk: int = 16 << 20) -> tuple[float, float, int]:
    files = sorted(os.path.join(p, f) for p, _, fs in os.walk(root) for f in fs)
    buf = bytearray(chunk)
    t0, c0, total = time.perf_counter(), time.process_time(), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while (got := f.readinto(buf)) > 0:
                total += got
    return time.perf_counter() - t0, time.process_time() - c0, total


def _merge(best: tuple[torch.Tensor, torch.Tensor] | None, vals, idx):
    if best is not None:
        vals, idx = torch.cat([best[0], vals], 1), torch.cat([best[1], idx], 1)
    v, j = vals.topk(K, dim=1)
    return v, idx.gather(1, j)


def phase_limit(a) -> dict:
    """The scoring limit on the same numbers, the vectors file, the exact top-10s."""
    done = os.path.join(a.scratch, "limit_result.json")
    if not a.beside and os.path.exists(done):
        with open(done) as f:
            return json.load(f)  # measured beside the score phase
    from dattri_llm import GradientStorageManager
    from dattri_llm.attribution.index.vectors import block_vectors

    store = GradientStorageManager(a.store)
    test = GradientStorageManager(a.store + "_test")
    layers = store.layer_names
    q = torch.cat([block_vectors(test.load_record(i).gradient, layers, "test")
                   for i in range(len(test))]).float()  # fmt: skip
    test_hashes = [h for r in test.records() for h in r.hashes]
    qn = q / q.norm(dim=1, keepdim=True)
    n, dim = store.num_samples, q.shape[1]
    out = np.lib.format.open_memmap(a.vectors, "w+", np.float32, (n, dim))
    hashes: list[str] = []
    best = {"dot": None, "cosine": None}
    block = torch.empty(BLOCK, dim)
    fill, row, mm_s, mm_cpu, read_s = 0, 0, 0.0, 0.0, 0.0

    def flush(m: int) -> None:
        nonlocal mm_s, mm_cpu
        x = block[:m]
        t0, c0 = time.perf_counter(), time.thread_time()
        v, j = (q @ x.T).topk(K, dim=1)  # the limit: vectors already in memory, + top-k
        best["dot"] = _merge(best["dot"], v, j + row)
        mm_s += time.perf_counter() - t0
        mm_cpu += time.thread_time() - c0
        xn = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
        v, j = (qn @ xn.T).topk(K, dim=1)
        best["cosine"] = _merge(best["cosine"], v, j + row)
        out[row : row + m] = x.numpy()

    for i in range(len(store)):
        t0 = time.perf_counter()
        rec = store.load_record(i, layers=layers)
        g = block_vectors(rec.gradient, layers, "train")
        read_s += time.perf_counter() - t0
        hashes += rec.hashes
        b = g.shape[0]
        while b:
            take = min(b, BLOCK - fill)
            block[fill : fill + take] = g[g.shape[0] - b : g.shape[0] - b + take]
            fill, b = fill + take, b - take
            if fill == BLOCK:
                flush(fill)
                row, fill = row + BLOCK, 0
    if fill:
        flush(fill)
    out.flush()
    exact = {m: best[m][1].numpy().tolist() for m in best}
    with open(os.path.join(a.scratch, "exact_topk.json"), "w") as f:
        json.dump({**exact, "test": test_hashes,
                   "dot_hashes": [[hashes[j] for j in r] for r in exact["dot"]],
                   "cosine_hashes": [[hashes[j] for j in r] for r in exact["cosine"]]},
                  f)  # fmt: skip
    np.save(os.path.join(a.scratch, "queries.npy"), q.numpy())
    _read_files(a.store)  # first pass: bring the files into the page cache
    read_s2, read_cpu, nbytes = _read_files(a.store)
    return {"n": n, "dim": dim, "matmul_topk_s": mm_s, "matmul_topk_cpu_s": mm_cpu,
            "matmul_sps": n / mm_s, "matmul_sps_cpu": n / mm_cpu,
            "store_read_pagecache_s": read_s2, "store_read_pagecache_cpu_s": read_cpu,
            "store_read_bytes": nbytes, "store_read_GBps": nbytes / read_s2 / 1e9,
            "load_record_s": read_s}  # fmt: skip


def _ivf(faiss, dim: int, nlist: int, pq_m: int | None):
    quant, ip = faiss.IndexFlatIP(dim), faiss.METRIC_INNER_PRODUCT
    if pq_m is None:
        return faiss.IndexIVFFlat(quant, dim, nlist, ip)
    return faiss.IndexIVFPQ(quant, dim, nlist, pq_m, 8, ip)


def phase_faiss(a) -> dict:
    """One process per (metric, index) job, all at once; the exact-score cross-check."""
    jobs = [f"{m}:flat" for m in a.metrics] + [f"{m}:pq{p}" for m in a.pq_metrics for p in a.pq_m]
    procs = [_child(a, "faiss_job", job=j) for j in jobs] if not a.sequential else []
    results = [_collect(p) for p in procs] or [
        _collect(_child(a, "faiss_job", job=j)) for j in jobs
    ]
    with open(os.path.join(a.scratch, "exact_topk.json")) as f:
        exact = json.load(f)
    with open(os.path.join(a.scratch, "score_topk.json")) as f:
        scored = json.load(f)
    pos = {h: i for i, h in enumerate(scored["test"])}
    same = [set(scored["proponents"][pos[h]]) == set(exact["dot_hashes"][qi])
            for qi, h in enumerate(exact["test"])]  # fmt: skip
    return {
        "jobs": dict(zip(jobs, results)),
        "rows": [r for res in results for r in res.get("rows", [])],
        "exact_dot_top10_equals_attribute_from_cache": float(np.mean(same)),
    }


def phase_faiss_job(a) -> dict:
    from dattri_llm.attribution.index.kinds import import_faiss

    faiss = import_faiss()
    faiss.omp_set_num_threads(1)
    metric, what = a.job.split(":")
    pq_m = None if what == "flat" else int(what[2:])
    x = np.load(a.vectors, mmap_mode="r")
    n, dim = x.shape
    with open(os.path.join(a.scratch, "exact_topk.json")) as f:
        truth = json.load(f)[metric]
    rng = np.random.default_rng(0)
    nlist = a.nlist or int(np.sqrt(n))
    train_ids = np.sort(rng.choice(n, min(n, a.train_per_list * nlist), replace=False))

    def prep(v: np.ndarray) -> np.ndarray:
        v = np.ascontiguousarray(v, dtype=np.float32)
        if metric == "cosine":
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
        return v

    qq = prep(np.load(os.path.join(a.scratch, "queries.npy")))
    name = "ivf-flat" if pq_m is None else f"ivf-pq m={pq_m}"
    log(f"faiss {metric} {name}: training on {len(train_ids)} vectors, nlist={nlist}")
    index = _ivf(faiss, dim, nlist, pq_m)
    t0, c0 = time.perf_counter(), time.process_time()
    index.train(prep(x[train_ids]))
    train_s = time.perf_counter() - t0
    for i in range(0, n, BLOCK):
        index.add(prep(x[i : i + BLOCK]))
    build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    size = int(faiss.serialize_index(index).nbytes) if pq_m is not None else int(
        index.invlists.compute_ntotal() * (4 * dim + 8) + nlist * 4 * dim)  # fmt: skip
    log(f"  {metric} {name} built in {build_s:.0f} s (train {train_s:.0f} s)")
    rows = []
    for nprobe in a.nprobe if pq_m is None else a.nprobe_pq:
        index.nprobe = nprobe
        for rerank in [None] if pq_m is None else a.rerank:
            kk = K if rerank is None else rerank * K
            index.search(qq[:5], kk)  # warm-up
            t0, c0 = time.perf_counter(), time.process_time()
            _, ids = index.search(qq, kk)
            if rerank is not None:  # exact re-rank of the short list, from the mmap
                ids = _rerank(x, qq, ids, prep)
            s, cpu = time.perf_counter() - t0, time.process_time() - c0
            recall = float(np.mean([len(set(ids[i][:K]) & set(truth[i])) / K
                                    for i in range(len(qq))]))  # fmt: skip
            rows.append({
                "metric": metric, "index": name, "nlist": nlist, "nprobe": nprobe,
                "rerank": rerank, "build_s": build_s, "build_cpu_s": build_cpu,
                "train_s": train_s, "train_vectors": len(train_ids), "index_bytes": size,
                "ms_per_query": 1e3 * s / len(qq), "cpu_ms_per_query": 1e3 * cpu / len(qq),
                "recall": recall,
            })  # fmt: skip
            log(f"  {metric} {name} nprobe={nprobe} rerank={rerank}: "
                f"{1e3 * s / len(qq):.2f} ms/query recall@10 {recall:.3f}")  # fmt: skip
    return {"rows": rows}


def _rerank(x: np.ndarray, q: np.ndarray, ids: np.ndarray, prep) -> np.ndarray:
    out = np.empty((len(q), K), dtype=np.int64)
    for i in range(len(q)):
        cand = ids[i][ids[i] >= 0]
        order = np.argsort(cand)  # sorted reads of the memory-mapped rows
        cand = cand[order]
        scores = prep(x[cand]) @ q[i]
        out[i] = cand[np.argsort(-scores)[:K]]
    return out


GINDEX_PARAMS = {  # the public API's kinds at this scale (ivf: sqrt(N) lists, 40 per list)
    "flat": {},
    "ivf": {"nlist": 1000, "train_size": 40_000, "pq_m": 128},
    "ivf256": {"nlist": 1000, "train_size": 40_000, "pq_m": 256},
    "hnsw": {},
    "ivf512x4": {"nlist": 1000, "train_size": 40_000, "pq_m": 512, "pq_bits": 4},
    "auto": {},  # above 2.5e8 numbers: kinds.auto_ivf_params (IVF-PQ 4-bit fast scan, re-rank)
}


def _exact_hashes(a, metric: str) -> list[list[str]] | None:
    """The exact top-10 of each query (``limit`` phase, same store), as hashes; else None."""
    path = os.path.join(a.scratch, "exact_topk.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        exact = json.load(f)
    return exact.get(f"{metric}_hashes")


def rss_anon() -> int:
    """Current anonymous resident memory (not the page cache a memory map touches)."""
    return status_bytes("RssAnon")


def phase_gindex(a) -> dict:
    """``GradientIndex.build / open / search`` per kind; recall@10 vs the exact top-10."""
    from dattri_llm import GradientIndex, GradientStorageManager

    store = GradientStorageManager(a.store)
    rows = []
    exact = _exact_hashes(a, "cosine") if a.store.endswith("store_sparse_float32") else None
    for name in a.gindex_kinds:
        kind = "ivf" if name.startswith("ivf") else name
        d = os.path.join(a.scratch, f"gindex_{name}")
        t0, c0 = time.perf_counter(), time.process_time()
        GradientIndex.build(store, d, metric="cosine", kind=kind, overwrite=True,
                            show_progress=False, **GINDEX_PARAMS[name])  # fmt: skip
        build_s, build_cpu = time.perf_counter() - t0, time.process_time() - c0
        anon_built = rss_anon()
        t0, c0 = time.perf_counter(), time.process_time()
        idx = GradientIndex.open(d)
        open_s, open_cpu = time.perf_counter() - t0, time.process_time() - c0
        sweep = [{}]
        if idx.kind == "ivf":
            sweep += [{"nprobe": p, "rerank": r} for p in a.gindex_nprobe for r in a.gindex_rerank]
        for over in sweep:
            idx.search(a.store + "_test", k=K, **over)  # warm-up (page cache, FAISS buffers)
            t0, c0 = time.perf_counter(), time.process_time()
            s = idx.search(a.store + "_test", k=K, **over)
            search_s, search_cpu = time.perf_counter() - t0, time.process_time() - c0
            top = s.top_k(K)
            if exact is None:
                exact = top.proponent_hashes  # the first kind (flat) is the reference
            recall = float(np.mean([len(set(p) & set(e)) / K
                                    for p, e in zip(top.proponent_hashes, exact)]))  # fmt: skip
            rows.append({"kind": kind, "name": name, "params": {**idx.params, **over},
                         "build_s": build_s, "build_cpu_s": build_cpu, "open_s": open_s,
                         "open_cpu_s": open_cpu, "index_bytes": dir_bytes(d),
                         "search_ms_per_query": 1e3 * search_s / s.num_test,
                         "search_cpu_ms_per_query": 1e3 * search_cpu / s.num_test,
                         "recall_vs_flat": recall, "n": store.num_samples,
                         "peak_rss_bytes_so_far": peak_rss(), "rss_anon_bytes": rss_anon(),
                         "rss_anon_after_build_bytes": anon_built})  # fmt: skip
            r = rows[-1]
            log(f"gindex {name} {over}: build {build_s:.1f} s, {r['search_ms_per_query']:.2f} "
                f"ms/q ({r['search_cpu_ms_per_query']:.2f} CPU), recall {recall:.3f}")  # fmt: skip
        del idx
        shutil.rmtree(d, ignore_errors=True)
    return {"rows": rows}


PHASES = {"capture": phase_capture, "score": phase_score, "limit": phase_limit,
          "faiss": phase_faiss, "faiss_job": phase_faiss_job, "gindex": phase_gindex}  # fmt: skip


# ----------------------------------------------------------------------------------- driver
def _flags(a, over: dict) -> list[str]:
    argv = []
    for k, v in {**vars(a), **over}.items():
        if k in ("json", "only", "skip", "tag") or v is None or v is False or v == []:
            continue
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


def run_phase(a, phase: str, **over) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), *_flags(a, {**over, "phase": phase})]
    log(f"phase {phase} {over}")
    t0 = time.perf_counter()
    res = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
    if res.returncode:
        log(f"phase {phase} failed ({res.returncode})")
        return {"phase": phase, "failed": res.returncode, **over}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["phase_wall_s"] = time.perf_counter() - t0
    log(f"phase {phase} done: {json.dumps(out)[:400]}")
    return out


def driver(a) -> None:
    from million_data import prepare
    from utils.env import header

    os.makedirs(a.data, exist_ok=True)
    a.data_dir = os.path.join(a.data, f"data{a.seq}")
    meta = prepare(a.data_dir, a.seq, os.path.join(a.data, "wheels"))
    results_dir = os.path.join(BENCH_DIR, "results")
    path = os.path.join(results_dir, f"million_{a.n}{a.tag}")
    res: dict = {"header": header("1M real-gradient run"), "data": meta, "args": vars(a),
                 "phases": []}  # fmt: skip

    def save() -> None:
        with open(path + ".json", "w") as f:
            json.dump(res, f, indent=1)

    save()
    st = lambda style, dtype: os.path.join(a.data, f"store_{style}_{dtype}")  # noqa: E731
    main = st("sparse", "float32")
    scratch = os.path.join(a.data, "scratch")
    os.makedirs(scratch, exist_ok=True)
    common = {"scratch": scratch, "vectors": os.path.join(a.data, "vectors.npy")}

    def cap(style: str, dtype: str, n: int) -> tuple[str, dict]:
        return "capture", {"style": style, "dtype": dtype, "n": n, "store": st(style, dtype)}

    logra = st("logra", "float32")
    plan = [cap("sparse", "float32", a.n), ("score", {"store": main}), ("limit", {"store": main}),
            ("faiss", {"store": main}), cap("logra", "float32", a.logra_n),
            ("gindex", {"store": logra}), cap("sparse", "bfloat16", a.bf16_n),
            cap("logra", "bfloat16", a.bf16_n),
            ("gindex", {"store": main})]  # fmt: skip  # 8: the public API at the full N (--only 8)
    for j, (phase, over) in enumerate(plan):
        if phase in a.skip or (a.only and j not in a.only):
            continue
        r = run_phase(a, phase, **common, **over)
        res["phases"].append({"phase": phase, **over, "result": r})
        save()
        if phase == "capture" and "bfloat16" in over["store"] and not a.keep:
            shutil.rmtree(over["store"] + "_test", ignore_errors=True)
            shutil.rmtree(over["store"], ignore_errors=True)
    log(f"all done: {path}.json")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--logra-n", type=int, default=100_000)
    ap.add_argument("--bf16-n", type=int, default=50_000)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--plain", type=int, default=10_240, help="windows for the plain step")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--metrics", nargs="*", default=["cosine", "dot"])
    ap.add_argument("--nlist", type=int, default=None, help="default sqrt(N)")
    ap.add_argument("--train-per-list", type=int, default=40)
    ap.add_argument("--nprobe", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--pq-m", type=int, nargs="*", default=[128])
    ap.add_argument("--pq-metrics", nargs="*", default=["cosine"])
    ap.add_argument("--nprobe-pq", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--rerank", type=int, nargs="*", default=[10, 50])
    ap.add_argument("--gindex-kinds", nargs="*", default=["flat", "ivf", "hnsw"],
                    help=f"of {sorted(GINDEX_PARAMS)}")  # fmt: skip
    ap.add_argument("--gindex-nprobe", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--gindex-rerank", type=int, nargs="*", default=[4, 10, 25])
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--only", type=int, nargs="*", default=[], help="plan steps (0-7) to run")
    ap.add_argument("--tag", default="", help="suffix of the results files")
    ap.add_argument("--until", type=float, default=None,
                    help="unix time: a capture stops there (reports the N reached)")  # fmt: skip
    ap.add_argument("--keep", action="store_true", help="keep the side stores")
    ap.add_argument("--data", default="/work/wt/_data/bench1m")
    # per-phase (set by the driver)
    ap.add_argument("--phase")
    ap.add_argument("--style")
    ap.add_argument("--dtype")
    ap.add_argument("--store")
    ap.add_argument("--scratch")
    ap.add_argument("--vectors")
    ap.add_argument("--data-dir")
    ap.add_argument("--job", help="faiss_job: metric:flat | metric:pq<m>")
    ap.add_argument("--beside", action="store_true", help="limit: running beside score")
    ap.add_argument("--test-only", action="store_true", help="capture: the query store only")
    ap.add_argument("--sequential", action="store_true",
                    help="run score/limit and the FAISS jobs one after the other")  # fmt: skip
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.phase is None:
        driver(a)
        return
    out = PHASES[a.phase](a)
    out["peak_rss_bytes"] = peak_rss()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
