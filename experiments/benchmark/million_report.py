"""Markdown tables of the 1M run (``million.py``) and its peers, from the results JSON.

    python experiments/benchmark/million_report.py --main results/million_1000000_main.json \\
        --side results/million_1000000_side.json --bergson results/million_bergson_20000.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.table import md_table  # noqa: E402


def _mb(b: float | None) -> str:
    if b is None:
        return "—"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def _phases(path: str | None) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)["phases"]


def capture_table(phases: list[dict], n_full: int) -> str:
    rows = []
    for p in phases:
        r = p["result"]
        if p["phase"] != "capture" or "failed" in r:
            continue
        plain = 2 / sum(1 / x for x in r["plain_sps_before_after"])
        plain_cpu = 2 / sum(1 / x for x in r["plain_sps_cpu_before_after"])
        rows.append([
            f"`{r['style']}` 8 x 256", r["dtype"], f"{r['n']:,}",
            f"{r['capture_sps']:.0f} / {r['capture_sps_cpu']:.0f}",
            f"{plain:.0f} / {plain_cpu:.0f}",
            f"{r['ratio_to_plain']:.2f}x / {r['ratio_to_plain_cpu']:.2f}x",
            f"{r['bytes_per_sample']:,.0f} ({r['payload_bytes_per_sample']:,})",
            _mb(r["store_bytes"]), _mb(r["bytes_per_sample"] * n_full),
            _mb(r["peak_rss_bytes"]),
        ])  # fmt: skip
    return md_table(
        ["projection (2048 numbers)", "storage", "N captured", "capture samples/s (wall / CPU)",
         "plain step samples/s (wall / CPU)", "capture / plain (wall / CPU)",
         "bytes per sample (payload)", "store size", f"scaled to {n_full:,}", "peak RSS"],
        rows,
    )  # fmt: skip


def score_table(phases: list[dict]) -> tuple[str, dict]:
    by = {p["phase"]: p["result"] for p in phases}
    s, lim = by.get("score"), by.get("limit")
    if not s or not lim or "failed" in s or "failed" in lim:
        return "(score / limit phases missing)", {}
    read_sps = lim["n"] / lim["store_read_pagecache_s"]
    limit_wall = min(lim["matmul_sps"], read_sps)
    limit_cpu = min(lim["matmul_sps_cpu"], lim["n"] / max(lim["store_read_pagecache_cpu_s"], 1e-9))
    rows = [
        ["`attribute_from_cache(top_k=10)` (exact)",
         f"{s['score_s']:.1f} s / {s['score_cpu_s']:.1f} s",
         f"{s['score_sps']:,.0f} / {s['score_sps_cpu']:,.0f}", _mb(s["peak_rss_bytes"])],
        *([["the same, general path (`vector_scan.ENABLED = False`, one `load_record` per record)",
             f"{g['score_s']:.1f} s / {g['score_cpu_s']:.1f} s",
             f"{g['score_sps']:,.0f} / {g['score_sps_cpu']:,.0f}",
             "same top-10" if g["same_top10"] else "**top-10 differ**"]]
           if (g := s.get("general_path")) else []),
        ["torch matmul + top-k, vectors in memory (64k-row blocks)",
         f"{lim['matmul_topk_s']:.1f} s / {lim['matmul_topk_cpu_s']:.1f} s",
         f"{lim['matmul_sps']:,.0f} / {lim['matmul_sps_cpu']:,.0f}", "—"],
        ["sequential read of the store's files (page cache, 2nd pass)",
         f"{lim['store_read_pagecache_s']:.1f} s ({lim['store_read_GBps']:.1f} GB/s)",
         f"{read_sps:,.0f}", "—"],
        ["exact vectors pass (load_record + both exact top-10s + vectors file)", "—", "—",
         _mb(lim["peak_rss_bytes"])],
    ]  # fmt: skip
    facts = {
        "exact_ms_per_query": 1e3 * s["score_s"] / s["queries"],
        "ratio_wall": s["score_sps"] / limit_wall,
        "ratio_cpu": s["score_sps_cpu"] / limit_cpu,
        "limit_wall": limit_wall,
        "matmul_ms_per_query": 1e3 * lim["matmul_topk_s"] / s["queries"],
        "exact_cpu_ms_per_query": 1e3 * s["score_cpu_s"] / s["queries"],
        "matmul_cpu_ms_per_query": 1e3 * lim["matmul_topk_cpu_s"] / s["queries"],
    }
    table = md_table(
        [
            "what (N = {:,}, 100 queries, 2048 numbers)".format(s["n"]),
            "time (wall / CPU)",
            "samples/s (wall / CPU)",
            "peak RSS",
        ],
        rows,
    )
    return table, facts


def faiss_table(phases: list[dict], facts: dict) -> str:
    by = {p["phase"]: p["result"] for p in phases}
    f = by.get("faiss")
    if not f or "rows" not in f:
        return "(faiss phase missing)"
    exact, exact_cpu = facts.get("exact_ms_per_query"), facts.get("exact_cpu_ms_per_query")
    mm_cpu = facts.get("matmul_cpu_ms_per_query")
    rows = []
    for r in f["rows"]:
        setting = f"{r['index']} nlist={r['nlist']} nprobe={r['nprobe']}"
        if r["rerank"]:
            setting += f", exact re-rank of {r['rerank'] * 10} from the mmap"
        rows.append([
            r["metric"], setting, f"{r['build_s']:.0f} s ({r['build_cpu_s']:.0f} s CPU)",
            _mb(r["index_bytes"]), f"{r['ms_per_query']:.2f}", f"{r['cpu_ms_per_query']:.2f}",
            f"{r['recall']:.3f}",
            f"{exact_cpu / r['cpu_ms_per_query']:.1f}x ({exact / r['ms_per_query']:.0f}x)"
            if exact else "—",
            f"{mm_cpu / r['cpu_ms_per_query']:.1f}x" if mm_cpu else "—",
        ])  # fmt: skip
    peaks = ", ".join(f"{k}: {_mb(v.get('peak_rss_bytes'))}" for k, v in f["jobs"].items())
    peaks += " (VmHWM counts the pages of the memory-mapped vectors file it touched)"
    return md_table(
        ["metric", "index", "build", "index size", "ms / query (wall)", "CPU ms / query",
         "recall@10", "speed-up vs exact `top_k`, CPU (wall)", "vs matmul limit, CPU"],
        rows,
    ) + f"\n\nPeak RSS per job: {peaks}. Exact dot top-10 of the vectors pass equals " \
        f"`attribute_from_cache`'s proponents for " \
        f"{f['exact_dot_top10_equals_attribute_from_cache']:.0%} " \
        "of the queries."  # fmt: skip


def gindex_table(phases: list[dict], facts: dict | None = None) -> str:
    """The public API's rows; with the exact ``top_k``'s facts, the speed-up per query."""
    rows = []
    keys = ("nlist", "nprobe", "pq_m", "pq_bits", "rerank", "M", "efConstruction", "efSearch")
    for p in phases:
        if p["phase"] != "gindex" or "rows" not in p["result"]:
            continue
        for r in p["result"]["rows"]:
            params = ", ".join(f"{k}={v}" for k, v in r["params"].items()
                               if k in keys and v is not None)  # fmt: skip
            speed = "—"
            if facts:
                cpu = facts["exact_cpu_ms_per_query"] / r["search_cpu_ms_per_query"]
                speed = (
                    f"{cpu:.1f}x ({facts['exact_ms_per_query'] / r['search_ms_per_query']:.1f}x)"
                )
            rows.append([r.get("name", r["kind"]), params or "—", f"{r['n']:,}",
                         f"{r['build_s']:.1f} s ({r.get('build_cpu_s', float('nan')):.1f} s)",
                         _mb(r["index_bytes"]),
                         f"{r['search_ms_per_query']:.2f} "
                         f"({r.get('search_cpu_ms_per_query', float('nan')):.2f})",
                         f"{r['recall_vs_flat']:.3f}", speed])  # fmt: skip
        rows.append(
            ["(phase peak RSS)", "", "", "", "", "", _mb(p["result"]["peak_rss_bytes"]), ""]
        )
    return md_table(["kind", "parameters", "N", "`build()` wall (CPU)", "index dir",
                     "`search()` ms / query wall (CPU)", "recall@10 vs exact",
                     "speed-up vs exact `top_k`, CPU (wall)"], rows)  # fmt: skip


def bergson_table(path: str | None) -> str:
    if not path or not os.path.exists(path):
        return "(bergson not run)"
    with open(path) as f:
        b = json.load(f)
    w, c = b["build_wall_s"], b.get("build_cpu_s", {})
    rows = [["`bergson build` (marginal)",
             f"{b['marginal_sps']:.0f} / {b.get('marginal_sps_cpu', float('nan')):.0f} samples/s "
             "(wall / CPU)",
             f"{b['small']:,} windows: {w[str(b['small'])]:.0f} s ({c.get(str(b['small']), 0):.0f}"
             f" s CPU); {b['n']:,}: {w[str(b['n'])]:.0f} s ({c.get(str(b['n']), 0):.0f} s CPU)",
             _mb(b["index_bytes"])]]  # fmt: skip
    for r in b["query"]:
        rows.append([f"query, FAISS `{r['index']}` nprobe={r['nprobe']}",
                     f"{r['ms_per_query']:.2f} ms / query",
                     f"recall@10 vs Flat {r['recall_vs_flat']:.3f}",
                     f"open/build {r['open_or_build_s']:.1f} s"])  # fmt: skip
    return md_table([f"bergson {b['bergson']}", "speed", "detail", "size"], rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--main")
    ap.add_argument("--side")
    ap.add_argument("--bergson")
    ap.add_argument("--gindex", help="a gindex phase's JSON run on its own")
    ap.add_argument("--n-full", type=int, default=1_000_000)
    a = ap.parse_args()
    main_ph, side_ph = _phases(a.main), _phases(a.side)
    print("### Capture\n\n" + capture_table(main_ph + side_ph, a.n_full))
    table, facts = score_table(main_ph)
    print("\n### Exact `top_k` vs the limit\n\n" + table)
    if facts:
        print(f"\nexact per query {facts['exact_ms_per_query']:.1f} ms wall, "
              f"{facts['exact_cpu_ms_per_query']:.1f} ms CPU; score / limit: "
              f"{facts['ratio_wall']:.2f} (wall), {facts['ratio_cpu']:.2f} (CPU)")  # fmt: skip
    print("\n### FAISS sweep\n\n" + faiss_table(main_ph, facts))
    if a.gindex and os.path.exists(a.gindex):
        with open(a.gindex) as f:
            side_ph = [
                *side_ph,
                {"phase": "gindex", "result": json.loads(f.read().splitlines()[-1])},
            ]
    print("\n### `GradientIndex` (public API)\n\n" + gindex_table(main_ph + side_ph, facts))
    print("\n### bergson\n\n" + bergson_table(a.bergson))


if __name__ == "__main__":
    main()
