"""The attribution explorer's query latency, and ``dattri-llm capture`` throughput.

Model: the demo's GPT-2 (2 layers x 128, byte-level BPE of 2048 tokens trained on the corpus,
random weights: latency does not depend on what the model learnt). Corpus: paragraphs of
Python's documentation topics (``pydoc_data.topics``), repeated with a numbered suffix until
there are ``--docs`` distinct documents.

* **capture**: ``dattri-llm capture MODEL DATA --out STORE`` (in-process, model loading
  included) against a hand-written loop on the same model, layers, projection, batch size and
  per-sample summed loss (``HookManager`` + ``OffloadCallback``), interleaved repeats.
* **stores**: the real capture of ``--docs`` documents, and a store of ``--synthetic`` samples
  made by writing random vectors of the same layers and projected widths (fast to build; the
  explorer's cost depends on the sizes, not on the values).
* **explorer**: ``Explorer.attribute(prompt, completion, k=10)`` per query, split into the
  query gradient (``query_blocks``: forward + backward) and the scoring / search; on the
  synthetic store also through a flat ``GradientIndex`` (cosine).
* **HTTP**: ``POST /api/attribute`` through a real uvicorn server on loopback, 1 and 4
  concurrent clients (threads, ``http.client``), each sending ``--requests`` requests.

Every timing gives wall time and the process's CPU time (all its threads: the server runs in
this process).

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
def capture_cli(model_dir: Path, data: Path, out: Path, batch: int) -> None:
    from dattri_llm.cli import main

    rc = main(
        [
            "capture",
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
def synthetic_store(real: Path, out: Path, n: int, rows: int = 1000) -> int:
    """``n`` samples of random vectors with the layers and widths of ``real``'s records.

    Returns the numbers per sample (the sum of the layers' widths).
    """
    import torch

    from dattri_llm import GradientStorageManager
    from dattri_llm.gradient.gradient import Gradient, GradientRecord
    from dattri_llm.gradient.layer_gradient import Materialized
    from dattri_llm.gradient.sources import DiskGradientSource

    first = next(iter(DiskGradientSource(GradientStorageManager(str(real)))))
    template = first.gradient
    meta = dict(first.metadata)
    store = GradientStorageManager(str(out), mode="overwrite")
    gen = torch.Generator().manual_seed(0)
    for step, start in enumerate(range(0, n, rows)):
        b = min(rows, n - start)
        layers = {}
        for name, lg in template.layers.items():
            m = lg.materialize()
            data = torch.randn(b, *m.data.shape[1:], generator=gen, dtype=m.data.dtype)
            layers[name] = Materialized(data, m.layer_type, dict(m.module_kwargs))
        hashes = [secrets.token_hex(32) for _ in range(b)]
        store.write(GradientRecord(step, hashes, Gradient(layers), first.checkpoint, meta))
    store.close()
    shutil.copy(real / "capture.json", out / "capture.json")
    return sum(lg.materialize().data[0].numel() for lg in template.layers.values())


# ---- explorer ---------------------------------------------------------------------------------
def bench_explorer(explorer, queries: list[tuple[str, str]], index=None) -> dict:
    """Per query: the query gradient, the scoring (or index search), and the whole call."""
    grad_w, grad_c, score_w, score_c, total_w, total_c = [], [], [], [], [], []
    for prompt, completion in queries:
        w0, c0 = clock()
        blocks = explorer.query_blocks(prompt, completion)
        w1, c1 = clock()
        if index is not None:
            index.search(blocks, K).top_k(K)
        else:
            explorer.attributor.attribute_sources(explorer._train_source(), blocks, top_k=K).top_k(
                K
            )
        w2, c2 = clock()
        result = explorer.attribute(prompt, completion, k=K)
        w3, c3 = clock()
        assert len(result.results) == min(K, explorer.num_train)
        grad_w.append(1e3 * (w1 - w0))
        grad_c.append(1e3 * (c1 - c0))
        score_w.append(1e3 * (w2 - w1))
        score_c.append(1e3 * (c2 - c1))
        total_w.append(1e3 * (w3 - w2))
        total_c.append(1e3 * (c3 - c2))
    return {
        "query_gradient": summary(grad_w, grad_c),
        "scoring": summary(score_w, score_c),
        "attribute": summary(total_w, total_c),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_http(explorer, queries: list[tuple[str, str]], requests: int, clients_list) -> dict:
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
    f = lambda x: f"{x:.1f}"  # noqa: E731
    rows = []
    for store, r in res["explorer"].items():
        for part in ("query_gradient", "scoring", "attribute"):
            s = r[part]
            rows.append([store, part, s["n"], f(s["p50_ms"]), f(s["p95_ms"]), f(s["cpu_p50_ms"])])
    for store, r in res["http"].items():
        for clients, s in r.items():
            rows.append(
                [store, f"HTTP, {clients} client(s)", s["n"], f(s["p50_ms"]), f(s["p95_ms"]), ""]
            )
    text = "### Explorer query latency (k = 10)\n\n" + md_table(
        ["store", "part", "queries", "p50 ms", "p95 ms", "CPU p50 ms"], rows
    )
    hrows = [
        [
            store,
            clients,
            s["n"],
            f"{s['requests_per_s']:.2f}",
            f"{s['wall_s']:.2f}",
            f"{s['cpu_s']:.2f}",
        ]
        for store, r in res["http"].items()
        for clients, s in r.items()
    ]
    text += "\n### HTTP load test (loopback uvicorn)\n\n" + md_table(
        ["store", "clients", "requests", "requests/s", "wall s", "process CPU s"], hrows
    )
    c = res["capture"]
    crow = [
        [
            name,
            c["samples"],
            c["batch_size"],
            f"{c[name]['samples_per_s']:.1f}",
            f"{c[name]['samples_per_cpu_s']:.1f}",
            " / ".join(f"{w:.2f}" for w in c[name]["walls_s"]),
        ]
        for name in ("cli", "hand")
    ]
    text += "\n### Capture throughput (median of interleaved repeats)\n\n" + md_table(
        ["capture", "samples", "batch", "samples/s (wall)", "samples/CPU-s", "walls s"], crow
    )
    text += (
        f"\n`dattri-llm capture` / hand-written loop: {c['cli_over_hand']:.2f}x (wall), "
        f"{c['cli_over_hand_cpu']:.2f}x (CPU)\n"
    )
    text += (
        f"\nEach sample: {res['width']} float32 numbers; synthetic store "
        f"{res['synthetic_bytes'] / 2**30:.2f} GiB written in {res['synthetic_build_s']:.1f} s"
        + (f"; flat index built in {res['index_build_s']:.1f} s" if "index_build_s" in res else "")
        + "\n"
    )
    return text


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI-sized run")
    p.add_argument("--docs", type=int, help="documents captured for real (default 1000)")
    p.add_argument("--synthetic", type=int, help="synthetic store samples (default 100000)")
    p.add_argument("--queries", type=int, help="explorer queries per store (default 30)")
    p.add_argument("--requests", type=int, help="HTTP requests per client (default 15)")
    p.add_argument(
        "--big-queries",
        type=int,
        help="queries and HTTP requests per client on the synthetic "
        "store (default 10 and 3: a scan of it takes seconds)",
    )
    p.add_argument("--capture-repeats", type=int, help="interleaved capture repeats (default 3)")
    p.add_argument("--batch-size", type=int, default=8, help="capture batch size")
    p.add_argument("--no-index", action="store_true", help="skip the GradientIndex timing")
    p.add_argument("--out", help="write serve.json and serve.md into this directory")
    a = p.parse_args(argv)
    quick = {
        "docs": 64,
        "synthetic": 2000,
        "queries": 6,
        "requests": 3,
        "capture_repeats": 2,
        "big_queries": 3,
    }
    full = {
        "docs": 1000,
        "synthetic": 100000,
        "queries": 30,
        "requests": 15,
        "capture_repeats": 3,
        "big_queries": 10,
    }
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    head = header(
        "Explorer latency and capture throughput" + (" (quick)" if a.quick else ""),
        {"sizes": f"{a.docs} captured documents, {a.synthetic} synthetic samples"},
    )
    import torch

    from dattri_llm import Explorer
    from dattri_llm.cli.capture import load_model

    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    try:
        model_dir, paras = build_model(tmp)
        model, tokenizer = load_model(str(model_dir))
        docs = documents(paras, a.docs, tokenizer)
        data = tmp / "docs.jsonl"
        data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        res: dict = {"config": vars(a), "torch_threads": torch.get_num_threads()}
        res["capture"] = bench_capture(
            model_dir, model, tokenizer, docs, data, tmp, a.batch_size, a.capture_repeats
        )
        real = tmp / "cap_cli"  # the CLI's last capture is the real store
        synth = tmp / "synthetic"
        w0 = time.perf_counter()
        res["width"] = synthetic_store(real, synth, a.synthetic)
        res["synthetic_build_s"] = time.perf_counter() - w0
        res["synthetic_bytes"] = sum(f.stat().st_size for f in synth.rglob("*") if f.is_file())
        # queries: held-out-style prompt / completion splits of the paragraphs (reversed order)
        queries = []
        for para in reversed(paras):
            words = para.split()
            queries.append((" ".join(words[:8]), " " + " ".join(words[8:24])))
        queries = queries[: a.queries]
        res["explorer"], res["http"] = {}, {}
        small = queries[: a.big_queries]
        for name, path, qs, n_req in (
            (f"real {a.docs}", real, queries, a.requests),
            (f"synthetic {a.synthetic}", synth, small, max(1, a.big_queries // 3)),
        ):
            explorer = Explorer(model, tokenizer, path)
            explorer.attribute(*queries[0], k=K)  # warm-up (and the page cache)
            res["explorer"][name] = bench_explorer(explorer, qs)
            log(f"explorer {name}: {res['explorer'][name]['attribute']}")
            res["http"][name] = bench_http(explorer, qs, n_req, (1, 4))
        if not a.no_index:
            from dattri_llm import GradientIndex

            w0 = time.perf_counter()
            index = GradientIndex.build(
                str(synth), tmp / "index", metric="cosine", kind="flat", show_progress=False
            )
            res["index_build_s"] = time.perf_counter() - w0
            explorer = Explorer(model, tokenizer, synth, index=index)
            explorer.attribute(*queries[0], k=K)
            name = f"synthetic {a.synthetic} + flat index"
            res["explorer"][name] = bench_explorer(explorer, queries, index=index)
            res["http"][name] = bench_http(explorer, queries, a.requests, (1, 4))
            log(f"explorer {name}: {res['explorer'][name]['attribute']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = head + "\n" + report(res)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "serve-quick" if a.quick else "serve"
        Path(a.out, f"{tag}.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
        Path(a.out, f"{tag}.md").write_text(text, encoding="utf-8")
    return res


if __name__ == "__main__":
    main()
