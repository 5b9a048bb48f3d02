"""``kind="auto"``'s calibrated ``nprobe`` on real projected gradients: recall@10 on real queries.

Over a train store captured by ``million.py`` (its test store beside it, ``<store>_test``):

1. exact: ``TracInAttributor(normalized_grad=True).attribute_from_cache(top_k=10)`` (Grad-Cos),
   timed: the reference top-10 (proponents and opponents) and the exact ``top_k``'s cost;
2. ``GradientIndex.build(store, metric="cosine")`` (``kind="auto"``, forced above the flat
   limit): build time, the calibrated ``nprobe``, the recall measured at build
   (``expected_recall``, held-out train vectors) and its calibration time;
3. ``search(test, k=10)`` with the build's parameters, and with the former fixed rule
   (``nprobe = max(8, nlist / 16)``), then an ``nprobe`` sweep: recall@10 on the real queries
   (the lower of proponents / opponents, as the build measures it) and time per query.

The commands: ``docs/benchmarks/index.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from dattri_llm import AttributionArguments, GradientIndex, TracInAttributor  # noqa: E402
from dattri_llm.attribution.index import kinds  # noqa: E402

K = 10


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def recall(got: list[list[str]], want: list[list[str]]) -> float:
    return sum(len(set(g) & set(w)) for g, w in zip(got, want)) / (K * len(want))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256])
    a = ap.parse_args()
    torch.set_num_threads(1)
    kinds.import_faiss().omp_set_num_threads(1)
    test = a.store + "_test"
    scratch = tempfile.mkdtemp(dir=os.path.dirname(a.store))
    res: dict = {"store": a.store, "threads": 1}
    try:
        args = AttributionArguments(output_dir=scratch, use_cpu=True, show_progress=False)
        exact, wall, cpu = timed(
            lambda: TracInAttributor(args, normalized_grad=True).attribute_from_cache(
                a.store, test, top_k=K
            )
        )
        top = exact.top_k(K)
        want = (top.proponent_hashes, top.opponent_hashes)
        m = exact.num_test
        res["exact"] = {"n": exact.num_train, "queries": m, "ms_per_query": 1e3 * wall / m,
                        "cpu_ms_per_query": 1e3 * cpu / m}  # fmt: skip
        print(f"exact top_k: {res['exact']}", flush=True)
        kinds.AUTO_FLAT_MAX = 0  # the IVF branch of kind="auto" at any size
        path = os.path.join(scratch, "auto")
        _, wall, cpu = timed(lambda: GradientIndex.build(a.store, path, "cosine"))
        index = GradientIndex.open(path)
        cal = index.meta["parts"][0]["calibration"]
        res["build"] = {"seconds": wall, "cpu_seconds": cpu, "params": index.params,
                        "expected_recall": index.expected_recall, "calibration": cal,
                        "build_seconds": index.meta["build_seconds"]}  # fmt: skip
        print(f"build: {wall:.1f} s, nprobe {index.params['nprobe']}, held-out recall "
              f"{index.expected_recall:.3f}", flush=True)  # fmt: skip
        nlist = index.params["nlist"]
        old = max(8, nlist // 16)
        rows = []
        for name, over in [("calibrated", {}), ("former rule", {"nprobe": old})] + [
            (f"nprobe {p}", {"nprobe": p}) for p in a.sweep if p <= nlist
        ]:
            index.search(test, k=K, **over)  # warm-up: page cache, FAISS buffers
            s, wall, cpu = timed(lambda over=over: index.search(test, k=K, **over))
            t = s.top_k(K)
            pro, opp = recall(t.proponent_hashes, want[0]), recall(t.opponent_hashes, want[1])
            row = {"name": name, "nprobe": over.get("nprobe", index.params["nprobe"]),
                   "recall": min(pro, opp), "proponents": pro, "opponents": opp,
                   "ms_per_query": 1e3 * wall / m, "cpu_ms_per_query": 1e3 * cpu / m,
                   "speedup": res["exact"]["ms_per_query"] / (1e3 * wall / m),
                   "speedup_cpu": res["exact"]["cpu_ms_per_query"] / (1e3 * cpu / m)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        res["search"] = rows
        res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
