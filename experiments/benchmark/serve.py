"""The attribution explorer's query latency by store size, and ``dattri-llm capture`` throughput.

Model: the demo's GPT-2 (2 layers x 128, byte-level BPE of 2048 tokens trained on the corpus,
random weights: latency does not depend on what the model learnt). Corpus: paragraphs of
Python's documentation topics (``pydoc_data.topics``), repeated with a numbered prefix until
there are ``--docs`` distinct documents.

* **stores**, one per ``--sizes`` entry: up to ``--docs`` samples, captured for real by
  ``dattri-llm capture --projection P``; larger, random vectors of the real store's layers and
  widths (fast to write; the explorer's cost depends on the sizes, not on the values). A size
  whose store would exceed ``--max-store-gib`` is skipped, saying so.
* **explorer**: ``Explorer(model, tokenizer, store, index=--index)`` (``auto``: what
  ``dattri-llm serve`` does: scan a small store, build and cache an index for a large one);
  per query, ``attribute(prompt, completion, k=10)`` split into the model's forward +
  backward, the projection (time inside the hook manager's per-layer transforms), the search
  (store scan or index) and the rendering (the HTTP answer's JSON); through an approximate
  index, its recall@10 against a store scan.
* **HTTP**: ``POST /api/attribute`` through a real uvicorn server on loopback, each of
  ``--clients`` concurrent clients (threads, ``http.client``) sending ``--requests`` requests.
* **capture** (``--capture-repeats N``): ``dattri-llm capture MODEL DATA --out STORE``
  (in-process, model loading included) against a hand-written loop on the same model, layers,
  projection, batch size and per-sample summed loss, interleaved repeats.

The load average of the shared machine is printed beside the figures.

    OMP_NUM_THREADS=1 python experiments/benchmark/serve.py --sizes 1000,100000,1000000 \
        --clients 1,4,16 --out DIR
    OMP_NUM_THREADS=1 python experiments/benchmark/serve.py --quick --out /tmp/serve
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from utils.env import header  # noqa: E402
from utils.table import md_table  # noqa: E402

SEQ_LEN = 48
K = 10


def log(msg: str) -> None:
    print(f"[serve] {msg}", file=sys.stderr, flush=True)


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s), max(1, math.ceil(q / 100 * len(s)))) - 1]


def summary(wall_ms: list[float], cpu_ms: list[float] | None = None) -> dict:
    out = {"n": len(wall_ms), "p50_ms": pct(wall_ms, 50), "p95_ms": pct(wall_ms, 95)}
    if cpu_ms is not None:
        out["cpu_p50_ms"] = pct(cpu_ms, 50)
    return out


# ---- model, corpus ---------------------------------------------------------------------------
def build_model(workdir: Path) -> tuple[Path, list[str]]:
    """The demo's tokenizer and GPT-2, saved under ``workdir/model``; the corpus paragraphs."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    from dattri_llm.demo import build_tokenizer, load_corpus

    torch.manual_seed(0)
    paras = [t for _, t in load_corpus()]
    tok = build_tokenizer(paras, vocab_size=2048)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=128,
        vocab_size=2048,
        n_positions=SEQ_LEN,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    model_dir = workdir / "model"
    model.save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(model_dir)
    return model_dir, paras


def documents(paras: list[str], n: int, tokenizer) -> list[str]:
    """``n`` documents distinct in their first ``SEQ_LEN`` tokens (what a capture hashes).

    The paragraphs first, then copies with a numbered prefix; a document whose kept tokens
    repeat an earlier one's is left out, so both captures compute ``n`` gradients.
    """
    from dattri_llm.gradient.causal_lm import encode_sample

    out, seen = [], set()
    for i in range(100 * n):
        p = paras[i % len(paras)]
        doc = p if i < len(paras) else f"({i // len(paras)}) {p}"
        key = tuple(encode_sample(tokenizer, "", doc, max_length=SEQ_LEN)["input_ids"].tolist())
        if key not in seen:
            seen.add(key)
            out.append(doc)
            if len(out) == n:
                return out
    raise ValueError(f"could not make {n} distinct documents")


# ---- capture throughput -----------------------------------------------------------------------
def capture_cli(
    model_dir: Path, data: Path, out: Path, batch: int, projection: str = "sparse:1024"
) -> None:
    from dattri_llm.cli import main

    rc = main(
        [
            "capture",
            "--projection",
            projection,
            str(model_dir),
            str(data),
            "--out",
            str(out),
            "--batch-size",
            str(batch),
            "--max-length",
            str(SEQ_LEN),
            "--no-progress",
        ]
    )
    if rc != 0:
        raise SystemExit(f"dattri-llm capture failed ({rc})")


def capture_by_hand(model, tokenizer, docs: list[str], out: Path, batch: int) -> None:
    """The same capture written with the hook manager: summed loss per sample, one pass."""
    from dattri_llm import GradientStorageManager, HookManager, OffloadCallback
    from dattri_llm.gradient.causal_lm import (
        DEFAULT_PROJECTION,
        encode_sample,
        hook_config,
        pad_batch,
        parse_projection,
        summed_loss,
    )

    store = GradientStorageManager(str(out), mode="overwrite")
    config = hook_config(None, parse_projection(DEFAULT_PROJECTION), model)
    collate = pad_batch(tokenizer.pad_token_id)
    hm = HookManager(
        model,
        config=config,
        callbacks=[
            OffloadCallback(offload_interval=1, file_manager=store, recording_type="per_sample")
        ],
    )
    with hm.collect(deregister_on_exit=True):
        for i in range(0, len(docs), batch):
            items = [
                encode_sample(tokenizer, "", d, max_length=SEQ_LEN) for d in docs[i : i + batch]
            ]
            model.zero_grad(set_to_none=True)
            summed_loss(model, collate(items)).backward()
    model.zero_grad(set_to_none=True)
    store.close()


def bench_capture(model_dir, model, tokenizer, docs, data, tmp, batch, repeats) -> dict:
    runs: dict[str, list[tuple[float, float]]] = {"cli": [], "hand": []}
    for r in range(repeats):
        order = ("cli", "hand") if r % 2 == 0 else ("hand", "cli")
        for name in order:
            out = tmp / f"cap_{name}"
            shutil.rmtree(out, ignore_errors=True)
            w0, c0 = clock()
            if name == "cli":
                capture_cli(model_dir, data, out, batch)
            else:
                capture_by_hand(model, tokenizer, docs, out, batch)
            w1, c1 = clock()
            runs[name].append((w1 - w0, c1 - c0))
            log(f"capture {name} #{r}: {len(docs) / (w1 - w0):.1f} samples/s")
    res = {}
    for name, rs in runs.items():
        wall = statistics.median(w for w, _ in rs)
        cpu = statistics.median(c for _, c in rs)
        res[name] = {
            "median_wall_s": wall,
            "median_cpu_s": cpu,
            "samples_per_s": len(docs) / wall,
            "samples_per_cpu_s": len(docs) / cpu,
            "walls_s": [w for w, _ in rs],
        }
    res["cli_over_hand"] = res["cli"]["samples_per_s"] / res["hand"]["samples_per_s"]
    res["cli_over_hand_cpu"] = res["cli"]["samples_per_cpu_s"] / res["hand"]["samples_per_cpu_s"]
    res["samples"], res["batch_size"], res["repeats"] = len(docs), batch, repeats
    return res


# ---- synthetic store --------------------------------------------------------------------------
def synthetic_store(real: Path, out: Path, n: int, rows: int = 1000, noise: float = 0.5) -> int:
    """``n`` samples made from ``real``'s captured vectors: each a random captured sample's
    vector plus Gaussian noise (per layer, ``noise`` times that layer's norm), so an index meets
    the clusters of real gradients (every captured vector with its noisy copies, cosine ~0.9 to
    them) at any size, where pure noise has none and ranks at random.

    Returns the numbers per sample (the sum of the layers' widths).
    """
    import torch

    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient.gradient import Gradient, GradientRecord
    from dattri_llm.gradient.layer_gradient import Materialized
    from dattri_llm.gradient.sources import DiskGradientSource

    blocks = list(DiskGradientSource(GradientStorageManager(str(real))))
    first = blocks[0]
    meta = dict(first.metadata)
    kinds = {name: lg.materialize() for name, lg in first.gradient.layers.items()}
    captured = {
        name: torch.cat([b.gradient.layers[name].materialize().data for b in blocks])
        for name in kinds
    }
    count = next(iter(captured.values())).shape[0]
    store = GradientStorageManager(str(out), mode="overwrite")
    gen = torch.Generator().manual_seed(0)
    for step, start in enumerate(range(0, n, rows)):
        b = min(rows, n - start)
        source = torch.randint(count, (b,), generator=gen)
        layers = {}
        for name, m in kinds.items():
            base = captured[name][source]
            flat = base.reshape(b, -1)
            scale = noise * flat.norm(dim=1, keepdim=True) / flat.shape[1] ** 0.5
            data = flat + scale * torch.randn(flat.shape, generator=gen, dtype=flat.dtype)
            layers[name] = Materialized(
                data.reshape(base.shape), m.layer_type, dict(m.module_kwargs)
            )
        hashes = [secrets.token_hex(32) for _ in range(b)]
        store.write(GradientRecord(step, hashes, Gradient(layers), first.checkpoint, meta))
    store.close()
    shutil.copy(real / "capture.json", out / "capture.json")
    return sum(m.data[0].numel() for m in kinds.values())


# ---- explorer ---------------------------------------------------------------------------------
class StageClock:
    """Wall time spent in the hook manager's per-layer projection, summed while installed.

    The projection runs inside the backward (in ``HookManager._apply_transforms``): timing that
    method splits a query's gradient into the model's forward + backward and the projection.
    """

    def __init__(self) -> None:
        from dattri_llm.gradient.hooks.manager import HookManager

        self.owner, self.total = HookManager, 0.0
        self.original = HookManager._apply_transforms
        clock = self

        def timed(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return clock.original(self, *args, **kwargs)
            finally:
                clock.total += time.perf_counter() - t0

        HookManager._apply_transforms = timed

    def close(self) -> None:
        self.owner._apply_transforms = self.original


def bench_explorer(explorer, queries: list[tuple[str, str]]) -> dict:
    """Per query: forward + backward, projection, search, rendering, and the whole call.

    Every other query is timed by stage (``query_blocks`` with the projection clock, then the
    search); the others by whole ``attribute`` call, then the HTTP answer's JSON built from
    its result. No query is asked twice.
    """
    from dattri_llm.cli.serve import answer_json

    stages = {k: [] for k in ("forward_backward", "projection", "search", "render", "attribute")}
    clock = StageClock()
    try:
        # every query is asked once: a repeated one would find its re-ranked rows (an ivf
        # index reads them from a memory-mapped file) already in memory
        for i, (prompt, completion) in enumerate(queries):
            if i % 2:  # the whole call, then the JSON the server sends
                w0 = time.perf_counter()
                result = explorer.attribute(prompt, completion, k=K)
                w1 = time.perf_counter()
                json.dumps(answer_json(result))
                stages["attribute"].append(1e3 * (w1 - w0))
                stages["render"].append(1e3 * (time.perf_counter() - w1))
                assert len(result.results) == min(K, explorer.num_train)
                continue
            clock.total = 0.0  # the stages one by one
            w0 = time.perf_counter()
            blocks = explorer.query_blocks(prompt, completion)
            w1 = time.perf_counter()
            if explorer.index is not None:
                score = explorer.index.search(blocks, K)
            else:
                score = explorer.attributor.attribute_sources(
                    explorer._train_source(), blocks, top_k=K
                )
            score.top_k(K)
            stages["forward_backward"].append(1e3 * (w1 - w0 - clock.total))
            stages["projection"].append(1e3 * clock.total)
            stages["search"].append(1e3 * (time.perf_counter() - w1))
    finally:
        clock.close()
    return {k: summary(v) for k, v in stages.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_http(explorer, queries: list[tuple[str, str]], requests: int, clients_list) -> dict:
    """Latency of ``POST /api/attribute`` through uvicorn, ``requests`` per client."""
    import uvicorn

    from dattri_llm.cli.serve import build_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(explorer), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    out = {}
    try:
        for clients in clients_list:
            lat: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()

            def client(c: int, lat: list, errors: list, lock: threading.Lock) -> None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                conn.connect()
                # headers and body leave in two writes: without this, Nagle's algorithm and the
                # server's delayed ACK add ~40 ms to every request (a client artefact)
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for r in range(requests):
                    prompt, completion = queries[(c * requests + r) % len(queries)]
                    body = json.dumps({"prompt": prompt, "completion": completion, "k": K})
                    t0 = time.perf_counter()
                    conn.request(
                        "POST", "/api/attribute", body, {"Content-Type": "application/json"}
                    )
                    resp = conn.getresponse()
                    data = resp.read()
                    dt = 1e3 * (time.perf_counter() - t0)
                    with lock:
                        if resp.status != 200 or len(json.loads(data)["results"]) == 0:
                            errors.append(f"{resp.status}: {data[:200]!r}")
                        lat.append(dt)
                conn.close()

            w0, c0 = clock()
            threads = [
                threading.Thread(target=client, args=(c, lat, errors, lock)) for c in range(clients)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            w1, c1 = clock()
            if errors:
                raise RuntimeError(f"HTTP errors: {errors[:3]}")
            out[str(clients)] = {
                **summary(lat),
                "requests_per_s": len(lat) / (w1 - w0),
                "wall_s": w1 - w0,
                "cpu_s": c1 - c0,
            }
            log(f"http {clients} clients: p50 {out[str(clients)]['p50_ms']:.1f} ms")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return out


# ---- report -----------------------------------------------------------------------------------
def report(res: dict) -> str:
    f = lambda x: f"{x:,.1f}" if x < 100 else f"{x:,.0f}"  # noqa: E731
    pf = lambda s: f"{f(s['p50_ms'])} / {f(s['p95_ms'])}"  # noqa: E731
    clients = [str(c) for c in res["config"]["clients"]]
    head = ["samples", "search", "exact", "fwd+bwd", "projection", "search ms", "render",
            "`attribute()`"] + [f"HTTP {c} client{'s' * (c != '1')}" for c in clients]  # fmt: skip
    rows = []
    for r in res["sizes"]:
        if "skipped" in r:
            rows.append([f"{r['samples']:,}", r["skipped"]] + [""] * (len(head) - 2))
            continue
        e = r["explorer"]
        rows.append(
            [f"{r['samples']:,}", r["search"], "yes" if r["exact"] else "no"]
            + [
                pf(e[k])
                for k in ("forward_backward", "projection", "search", "render", "attribute")
            ]
            + [pf(r["http"][c]) for c in clients]
        )
    text = "### Explorer latency, p50 / p95 in ms (k = 10)\n\n" + md_table(head, rows)
    rows = [
        [
            f"{r['samples']:,}", r.get("kind", ""), r["width"], f"{r['store_gib']:.2f}",
            f"{r['store_s']:.1f}", f"{r['index_s']:.1f}" if r.get("index_s") is not None else "—",
            r.get("recall", ""), r["load"],
        ]
        for r in res["sizes"]
        if "skipped" not in r
    ]  # fmt: skip
    text += "\n### Stores and indexes\n\n" + md_table(
        [
            "samples",
            "index",
            "numbers / sample",
            "store GiB",
            "store written s",
            "index s",
            "recall@10 vs scan",
            "load avg (1 min) after",
        ],
        rows,
    )
    hrows = [
        [f"{r['samples']:,}", c, s["n"], f"{s['requests_per_s']:.2f}", f"{s['cpu_s']:.2f}"]
        for r in res["sizes"]
        if "skipped" not in r
        for c, s in r["http"].items()
    ]
    text += "\n### HTTP load (loopback uvicorn)\n\n" + md_table(
        ["samples", "clients", "requests", "requests/s", "process CPU s"], hrows
    )
    if "capture" in res:
        c = res["capture"]
        crow = [
            [
                name, c["samples"], c["batch_size"], f"{c[name]['samples_per_s']:.1f}",
                f"{c[name]['samples_per_cpu_s']:.1f}",
                " / ".join(f"{w:.2f}" for w in c[name]["walls_s"]),
            ]
            for name in ("cli", "hand")
        ]  # fmt: skip
        text += "\n### Capture throughput (median of interleaved repeats)\n\n" + md_table(
            ["capture", "samples", "batch", "samples/s (wall)", "samples/CPU-s", "walls s"], crow
        )
        text += (
            f"\n`dattri-llm capture` / hand-written loop: {c['cli_over_hand']:.2f}x (wall), "
            f"{c['cli_over_hand_cpu']:.2f}x (CPU)\n"
        )
    return text


def recall_vs_scan(explorer, scan, queries) -> float:
    """Mean share of the scan's top-``K`` that the explorer's index returns."""
    found = []
    for prompt, completion in queries:
        want = {h.id for h in scan.attribute(prompt, completion, k=K).results}
        got = {h.id for h in explorer.attribute(prompt, completion, k=K).results}
        found.append(len(want & got) / len(want))
    return statistics.mean(found)


def load_avg() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run (sizes 64,2000)")
    p.add_argument(
        "--sizes",
        help="store sizes in samples (default 1000,100000,1000000); up to --docs are captured "
        "for real, larger ones are synthetic",
    )
    p.add_argument("--clients", default="1,4,16", help="concurrent HTTP clients, per size")
    p.add_argument("--docs", type=int, default=1000, help="documents captured for real")
    p.add_argument("--projection", default="sparse:1024", help="the capture's projection")
    p.add_argument(
        "--index",
        default="auto",
        help="what the explorer searches: auto (as dattri-llm serve: scan a small store, index "
        "a large one), none (scan), or a GradientIndex kind (flat, ivf, hnsw)",
    )
    p.add_argument("--queries", type=int, default=30, help="explorer queries per size")
    p.add_argument("--requests", type=int, default=8, help="HTTP requests per client")
    p.add_argument(
        "--scan-queries",
        type=int,
        default=5,
        help="queries per size on a store scan of over 1e8 numbers (seconds each)",
    )
    p.add_argument(
        "--recall-queries",
        type=int,
        default=10,
        help="queries compared with a store scan, per approximate index",
    )
    p.add_argument(
        "--max-store-gib", type=float, default=16.0, help="skip a size whose store is larger"
    )
    p.add_argument(
        "--capture-repeats",
        type=int,
        default=0,
        help="also time dattri-llm capture against a hand-written loop",
    )
    p.add_argument("--batch-size", type=int, default=8, help="capture batch size")
    p.add_argument("--workdir", help="where stores go (default: a temporary directory)")
    p.add_argument("--out", help="write serve.json and serve.md into this directory")
    a = p.parse_args(argv)
    sizes = [
        int(x) for x in (a.sizes or ("64,2000" if a.quick else "1000,100000,1000000")).split(",")
    ]
    a.clients = [int(x) for x in a.clients.split(",")]
    if a.quick:
        a.docs, a.queries, a.requests = min(a.docs, 64), min(a.queries, 6), min(a.requests, 3)
    head = header(
        "Explorer latency" + (" (quick)" if a.quick else ""),
        {
            "sizes": ", ".join(f"{n:,}" for n in sizes),
            "projection": a.projection,
            "index": a.index,
            "clients": ", ".join(map(str, a.clients)),
        },
    )
    import torch

    from dattri_llm import Explorer, GradientIndex
    from dattri_llm.cli.capture import load_model

    tmp = Path(a.workdir or tempfile.mkdtemp(prefix="serve_bench_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        model_dir, paras = build_model(tmp)
        model, tokenizer = load_model(str(model_dir))
        docs = documents(paras, a.docs, tokenizer)
        data = tmp / "docs.jsonl"
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        res: dict = {"config": vars(a), "torch_threads": torch.get_num_threads(), "sizes": []}
        real = tmp / "real"
        capture_cli(model_dir, data, real, a.batch_size, a.projection)
        if a.capture_repeats:
            res["capture"] = bench_capture(
                model_dir, model, tokenizer, docs, data, tmp, a.batch_size, a.capture_repeats
            )
        queries = []  # held-out-style prompt / completion splits of the paragraphs
        for para in reversed(paras):
            words = para.split()
            queries.append((" ".join(words[:8]), " " + " ".join(words[8:24])))
        warm, queries = queries[a.queries % len(queries)], queries[: a.queries]
        for n in sizes:
            row: dict = {"samples": n}
            res["sizes"].append(row)
            w0 = time.perf_counter()
            if n <= a.docs:
                store = tmp / f"real_{n}"
                if n == a.docs:
                    store = real
                else:
                    (tmp / f"docs_{n}.jsonl").write_text(
                        "".join(json.dumps({"text": d}) + "\n" for d in docs[:n]), "utf-8"
                    )
                    capture_cli(
                        model_dir, tmp / f"docs_{n}.jsonl", store, a.batch_size, a.projection
                    )
                row["width"] = width_of(store)
            else:
                row["width"] = width_of(real)
                need = n * row["width"] * 4 / 2**30
                if need > a.max_store_gib:
                    row["skipped"] = (
                        f"skipped: its store is {need:.0f} GiB of float32 (> --max-store-gib "
                        f"{a.max_store_gib:g}); a smaller --projection fits"
                    )
                    log(f"{n}: {row['skipped']}")
                    continue
                store = tmp / f"synthetic_{n}"
                synthetic_store(real, store, n)
            row["store_s"] = time.perf_counter() - w0
            row["store_gib"] = (
                sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**30
            )
            log(f"{n}: store {row['store_gib']:.2f} GiB in {row['store_s']:.1f} s")
            w0 = time.perf_counter()
            if a.index in ("auto", "none"):
                explorer = Explorer(
                    model, tokenizer, store, index=None if a.index == "none" else "auto"
                )
            else:
                index = GradientIndex.build(
                    str(store),
                    tmp / f"index_{n}",
                    metric="cosine",
                    kind=a.index,
                    overwrite=True,
                    show_progress=False,
                )
                explorer = Explorer(model, tokenizer, store, index=index)
            row["index_s"] = time.perf_counter() - w0 if explorer.index is not None else None
            row["kind"] = explorer.index.kind if explorer.index is not None else "scan"
            row["search"] = "store scan" if explorer.index is None else f"{row['kind']} index"
            row["exact"] = explorer.exact
            log(f"{n}: {row['search']} ready in {time.perf_counter() - w0:.1f} s")
            explorer.attribute(*warm, k=K)  # warm-up, with a query not timed after
            slow = explorer.index is None and n * row["width"] > 1e8
            qs = queries[: a.scan_queries] if slow else queries
            row["explorer"] = bench_explorer(explorer, qs)
            log(f"{n}: attribute() {row['explorer']['attribute']}")
            if not explorer.exact:
                scan = Explorer(model, tokenizer, store)
                row["recall"] = f"{recall_vs_scan(explorer, scan, queries[: a.recall_queries]):.3f}"
                log(f"{n}: recall@{K} {row['recall']}")
            requests = max(1, a.requests // 4) if slow else a.requests
            row["http"] = bench_http(explorer, qs, requests, a.clients)
            row["load"] = load_avg()
            explorer.close()
            del explorer
            if n > a.docs:
                shutil.rmtree(store, ignore_errors=True)
                shutil.rmtree(Path(f"{store}.index"), ignore_errors=True)
    finally:
        if a.workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = head + f"- load average at the end {load_avg()}\n\n" + report(res)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "serve-quick" if a.quick else "serve"
        Path(a.out, f"{tag}.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
        Path(a.out, f"{tag}.md").write_text(text, encoding="utf-8")
    return res


def width_of(store: Path) -> int:
    """Numbers per sample of a store (its layers' widths summed)."""
    from dattri_llm import GradientStorageManager

    first = GradientStorageManager(str(store)).load_record(0).gradient
    return sum(int(lg.materialize().data[0].numel()) for lg in first.layers.values())


if __name__ == "__main__":
    main()
