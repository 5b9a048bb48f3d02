"""The attribution explorer's query latency by store size (``dattri-llm serve``'s default).

The demo's GPT-2 (2 x 128, random weights), paragraphs of Python's docs made into ``--docs``
distinct documents and captured by ``dattri-llm capture``; a size above ``--docs`` is
synthetic (captured vectors plus noise). Per size: ``Explorer(..., index="auto")``, each query's
``attribute(prompt, completion, k=10)`` split into forward + backward, projection, search and
rendering, recall@10 of an approximate index against a store scan, and ``POST /api/attribute``
through uvicorn on loopback under ``--clients`` concurrent clients. Setup: docs/benchmarks/serve.md.

    OMP_NUM_THREADS=1 python experiments/benchmark/serve.py --sizes 1000,100000 --docs 100000
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


def pct(xs: list[float], q: float) -> float:
    """The ``q`` percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s), max(1, math.ceil(q / 100 * len(s)))) - 1]


def summary(wall_ms: list[float]) -> dict:
    return {"n": len(wall_ms), "p50_ms": pct(wall_ms, 50), "p95_ms": pct(wall_ms, 95)}


def build_model(workdir: Path) -> tuple[Path, list[str]]:
    """The demo's tokenizer and GPT-2, saved under ``workdir/model``; the corpus paragraphs."""
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    from dattri_llm.demo import build_tokenizer, load_corpus

    torch.manual_seed(0)
    paras = [t for _, t in load_corpus()]
    tok = build_tokenizer(paras, vocab_size=2048)
    cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=2048,
                                  n_positions=SEQ_LEN, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model_dir = workdir / "model"
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(model_dir)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>").save_pretrained(model_dir)
    return model_dir, paras


def documents(paras: list[str], n: int, tokenizer) -> list[str]:
    """``n`` documents distinct in their first ``SEQ_LEN`` tokens (what a capture hashes): the
    paragraphs, then copies with a numbered prefix, each kept only if its tokens are new."""
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


def capture_cli(model_dir: Path, docs: list[str], out: Path, projection: str) -> None:
    from dattri_llm.cli import main

    data = out.with_suffix(".jsonl")
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    argv = ["capture", "--projection", projection, str(model_dir), str(data), "--out", str(out),
            "--batch-size", "8", "--max-length", str(SEQ_LEN), "--no-progress"]  # fmt: skip
    if main(argv) != 0:
        raise SystemExit("dattri-llm capture failed")


def synthetic_store(real: Path, out: Path, n: int, rows: int = 1000, noise: float = 0.5) -> None:
    """``n`` samples, each a random captured sample's vector of ``real`` plus Gaussian noise
    (per layer, ``noise`` times that layer's norm: cosine ~0.9 to its source), so an index
    meets the clusters of real gradients, where pure noise has none."""
    import torch

    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient.gradient import Gradient, GradientRecord
    from dattri_llm.gradient.layer_gradient import Materialized
    from dattri_llm.gradient.sources import DiskGradientSource

    blocks = list(DiskGradientSource(GradientStorageManager(str(real))))
    first = blocks[0]
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
            kw = dict(m.module_kwargs)
            layers[name] = Materialized(data.reshape(base.shape), m.layer_type, kw)
        hashes = [secrets.token_hex(32) for _ in range(b)]
        meta = dict(first.metadata)
        store.write(GradientRecord(step, hashes, Gradient(layers), first.checkpoint, meta))
    store.close()
    shutil.copy(real / "capture.json", out / "capture.json")


class StageClock:
    """Wall time in the hook manager's per-layer projection (``_apply_transforms``, inside the
    backward), summed while installed: it splits a query's gradient into model and projection."""

    def __init__(self) -> None:
        from dattri_llm.gradient.hooks.manager import HookManager

        self.owner, self.total = HookManager, 0.0
        self.original = original = HookManager._apply_transforms

        def timed(hm, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(hm, *args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        HookManager._apply_transforms = timed

    def close(self) -> None:
        self.owner._apply_transforms = self.original


def bench_explorer(explorer, queries: list[tuple[str, str]]) -> dict:
    """Every other query timed by stage (``query_blocks`` with the projection clock, then the
    search), the others as whole ``attribute`` calls, then the JSON the server sends. No query
    is asked twice: a repeated one would find its re-ranked rows already in memory."""
    from dattri_llm.cli.serve import answer_json

    stages = {k: [] for k in ("forward_backward", "projection", "search", "render", "attribute")}
    clock = StageClock()
    try:
        for i, (prompt, completion) in enumerate(queries):
            w0 = time.perf_counter()
            if i % 2:
                result = explorer.attribute(prompt, completion, k=K)
                w1 = time.perf_counter()
                json.dumps(answer_json(result))
                stages["attribute"].append(1e3 * (w1 - w0))
                stages["render"].append(1e3 * (time.perf_counter() - w1))
                assert len(result.results) == min(K, explorer.num_train)
                continue
            clock.total = 0.0
            blocks = explorer.query_blocks(prompt, completion)
            w1 = time.perf_counter()
            if explorer.index is not None:
                score = explorer.index.search(blocks, K)
            else:
                source = explorer._train_source()
                score = explorer.attributor.attribute_sources(source, blocks, top_k=K)
            score.top_k(K)
            stages["forward_backward"].append(1e3 * (w1 - w0 - clock.total))
            stages["projection"].append(1e3 * clock.total)
            stages["search"].append(1e3 * (time.perf_counter() - w1))
    finally:
        clock.close()
    return {k: summary(v) for k, v in stages.items()}


def bench_http(explorer, queries: list[tuple[str, str]], requests: int, clients_list) -> dict:
    """Latency of ``POST /api/attribute`` through uvicorn, ``requests`` per client, each client
    a thread with its own keep-alive connection; every answer checked."""
    import uvicorn

    from dattri_llm.cli.serve import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(build_app(explorer), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def client(c: int, lat: list, errors: list) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.connect()
        # headers and body leave in two writes: without this, Nagle's algorithm and the
        # server's delayed ACK add ~40 ms to every request (a client artefact)
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for r in range(requests):
            prompt, completion = queries[(c * requests + r) % len(queries)]
            body = json.dumps({"prompt": prompt, "completion": completion, "k": K})
            t0 = time.perf_counter()
            conn.request("POST", "/api/attribute", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            lat.append(1e3 * (time.perf_counter() - t0))  # list.append is atomic
            if resp.status != 200 or len(json.loads(data)["results"]) == 0:
                errors.append(f"{resp.status}: {data[:200]!r}")
        conn.close()

    out = {}
    try:
        for clients in clients_list:
            lat: list[float] = []
            errors: list[str] = []
            w0, c0 = time.perf_counter(), time.process_time()
            threads = [threading.Thread(target=client, args=(c, lat, errors))
                       for c in range(clients)]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            if errors:
                raise RuntimeError(f"HTTP errors: {errors[:3]}")
            out[str(clients)] = {**summary(lat), "requests_per_s": len(lat) / wall,
                                 "wall_s": wall, "cpu_s": cpu}  # fmt: skip
            log(f"http {clients} clients: p50 {out[str(clients)]['p50_ms']:.1f} ms")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return out


def report(res: dict) -> str:
    f = lambda x: f"{x:,.1f}" if x < 100 else f"{x:,.0f}"  # noqa: E731
    pf = lambda s: f"{f(s['p50_ms'])} / {f(s['p95_ms'])}"  # noqa: E731
    clients = [str(c) for c in res["config"]["clients"]]
    stages = ("forward_backward", "projection", "search", "render", "attribute")
    head = ["samples", "search", "exact", "fwd+bwd", "projection", "search ms", "render",
            "`attribute()`"] + [f"HTTP {c} client{'s' * (c != '1')}" for c in clients]  # fmt: skip
    rows = [[f"{r['samples']:,}", r["search"], "yes" if r["exact"] else "no"]
            + [pf(r["explorer"][k]) for k in stages] + [pf(r["http"][c]) for c in clients]
            for r in res["sizes"]]  # fmt: skip
    text = "### Explorer latency, p50 / p95 in ms (k = 10)\n\n" + md_table(head, rows)
    index_s = lambda r: "—" if r["index_s"] is None else f"{r['index_s']:.1f}"  # noqa: E731
    rows = [[f"{r['samples']:,}", r["kind"], r["width"], f"{r['store_gib']:.2f}",
             f"{r['store_s']:.1f}", index_s(r), r.get("recall", ""), r["load"]]
            for r in res["sizes"]]  # fmt: skip
    text += "\n### Stores and indexes\n\n" + md_table(
        "samples|index|numbers / sample|store GiB|store written s|index s|recall@10 vs scan|"
        "load avg (1 min) after",
        rows,
    )
    rows = [[f"{r['samples']:,}", c, s["n"], f"{s['requests_per_s']:.2f}", f"{s['cpu_s']:.2f}"]
            for r in res["sizes"] for c, s in r["http"].items()]  # fmt: skip
    text += "\n### HTTP load (loopback uvicorn)\n\n"
    return text + md_table("samples|clients|requests|requests/s|process CPU s", rows)


def recall_vs_scan(explorer, scan, queries) -> float:
    """Mean share of the scan's top-``K`` that the explorer's index returns."""
    found = []
    for prompt, completion in queries:
        want = {h.id for h in scan.attribute(prompt, completion, k=K).results}
        got = {h.id for h in explorer.attribute(prompt, completion, k=K).results}
        found.append(len(want & got) / len(want))
    return statistics.mean(found)


def width_of(store: Path) -> int:
    """Numbers per sample of a store (its layers' widths summed)."""
    from dattri_llm import GradientStorageManager

    first = GradientStorageManager(str(store)).load_record(0).gradient
    return sum(int(lg.materialize().data[0].numel()) for lg in first.layers.values())


def bench_size(n: int, a, model, tokenizer, stores: dict, queries, warm) -> dict:
    """One store size: its store, the explorer, the latency, recall and HTTP figures."""
    from dattri_llm import Explorer

    row: dict = {"samples": n}
    w0 = time.perf_counter()
    store = stores["real"]
    if n < a.docs:
        store = stores["dir"] / f"real_{n}"
        capture_cli(stores["model_dir"], stores["docs"][:n], store, a.projection)
    elif n > a.docs:
        store = stores["dir"] / f"synthetic_{n}"
        synthetic_store(stores["real"], store, n)
    row["width"] = width_of(store)
    row["store_s"] = time.perf_counter() - w0
    row["store_gib"] = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) / 2**30
    log(f"{n}: store {row['store_gib']:.2f} GiB in {row['store_s']:.1f} s")
    w0 = time.perf_counter()
    explorer = Explorer(model, tokenizer, store, index="auto")
    row["index_s"] = time.perf_counter() - w0 if explorer.index is not None else None
    row["kind"] = explorer.index.kind if explorer.index is not None else "scan"
    row["search"] = "store scan" if explorer.index is None else f"{row['kind']} index"
    row["exact"] = explorer.exact
    explorer.attribute(*warm, k=K)  # warm-up, with a query not timed after
    row["explorer"] = bench_explorer(explorer, queries)
    log(f"{n}: {row['search']}, attribute() {row['explorer']['attribute']}")
    if not explorer.exact:
        scan = Explorer(model, tokenizer, store)
        row["recall"] = f"{recall_vs_scan(explorer, scan, queries[:10]):.3f}"
    row["http"] = bench_http(explorer, queries, a.requests, a.clients)
    row["load"] = f"{os.getloadavg()[0]:.1f}"
    explorer.close()
    if n > a.docs:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(Path(f"{store}.index"), ignore_errors=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run (sizes 64,2000)")
    p.add_argument("--sizes", help="store sizes (default 1000,100000); above --docs synthetic")
    p.add_argument("--clients", default="1,4,16", help="concurrent HTTP clients, per size")
    p.add_argument("--docs", type=int, default=1000, help="documents captured for real")
    p.add_argument("--projection", default="sparse:1024", help="the capture's projection")
    p.add_argument("--queries", type=int, default=30, help="explorer queries per size")
    p.add_argument("--requests", type=int, default=8, help="HTTP requests per client")
    p.add_argument("--workdir", help="where stores go (default: a temporary directory)")
    p.add_argument("--out", help="write serve.json and serve.md into this directory")
    a = p.parse_args(argv)
    sizes = [int(x) for x in (a.sizes or ("64,2000" if a.quick else "1000,100000")).split(",")]
    a.clients = [int(x) for x in a.clients.split(",")]
    if a.quick:
        a.docs, a.queries, a.requests = min(a.docs, 64), min(a.queries, 6), min(a.requests, 3)
    title = "Explorer latency" + (" (quick)" if a.quick else "")
    head = header(title, {"sizes": ", ".join(f"{n:,}" for n in sizes), "projection": a.projection,
                          "clients": ", ".join(map(str, a.clients))})  # fmt: skip
    from dattri_llm.cli.capture import load_model

    tmp = Path(a.workdir or tempfile.mkdtemp(prefix="serve_bench_"))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        model_dir, paras = build_model(tmp)
        model, tokenizer = load_model(str(model_dir))
        docs = documents(paras, a.docs, tokenizer)
        stores = {"dir": tmp, "model_dir": model_dir, "docs": docs, "real": tmp / "real"}
        capture_cli(model_dir, docs, stores["real"], a.projection)
        queries = []  # prompt / completion splits of the paragraphs
        for para in reversed(paras):
            words = para.split()
            queries.append((" ".join(words[:8]), " " + " ".join(words[8:24])))
        warm, queries = queries[a.queries % len(queries)], queries[: a.queries]
        res: dict = {"config": vars(a), "sizes": []}
        for n in sizes:
            res["sizes"].append(bench_size(n, a, model, tokenizer, stores, queries, warm))
    finally:
        if a.workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = head + f"- load average at the end {os.getloadavg()[0]:.1f}\n\n" + report(res)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "serve-quick" if a.quick else "serve"
        Path(a.out, f"{tag}.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
        Path(a.out, f"{tag}.md").write_text(text, encoding="utf-8")
    return res


if __name__ == "__main__":
    main()
