"""bergson 2.5.1 beside the 1M run (``million.py``): ``bergson build`` + its FAISS query.

Runs inside bergson's own virtual environment (``/work/wt/_venvs/bergson``: ``pip install
torch==2.13.0``, then ``pip install -c torch-cpu.txt bergson==2.5.1 faiss-cpu``, then
``pip uninstall -y torchvision torchaudio``; see ``../shared/ENVIRONMENT.md``), not with
dattri_llm. Same model weights, same windows, same projection size as ``million.py``:

* the model is saved as a Hugging Face directory; its position table is padded to 8192 rows
  (zeros) because bergson refuses a token batch larger than ``max_position_embeddings`` (16
  here), and the windows use positions 0-15 only, so every captured gradient is unchanged;
* the windows are given pre-tokenized (an ``input_ids`` column saved with ``save_to_disk``);
* ``--projection_dim 16`` (bergson's default ``per_module`` target: a 16 x 16 two-sided
  projection of each module: 256 numbers) on the 8 attention / MLP ``Conv1D`` layers
  (``--filter_modules lm_head``): 2048 numbers per sample, as ``logra`` 16 x 16 in million.py;
  ``--loss_reduction mean`` (each window's mean token loss, as million.py's per-sample loss);
  ``--token_batch_size 8192`` (512 windows of 16 tokens, million.py's batch).

``bergson build`` runs twice, on ``--small`` and ``--n`` windows, in fresh processes: the
marginal throughput ``(n - small) / (t_n - t_small)`` removes its start-up (imports, model
load, dataset map). The query: the 100 query windows built as a bergson index, then
``bergson.query.Attributor`` with a FAISS ``Flat`` and an ``IVF{nlist},Flat`` index (nprobe
sweep), unit-normalized (cosine), recall@10 against the Flat result.

    /work/wt/_venvs/bergson/bin/python experiments/benchmark/million_bergson.py --n 50000

bergson 2.5.1's FAISS query path calls ``isinstance(index, faiss.GpuIndex)``, which faiss-cpu
does not define (``AttributeError``); the script defines an empty ``faiss.GpuIndex`` class
first (nothing is ever an instance of it, as on a CPU-only build). Times are wall and CPU
(``RUSAGE_CHILDREN`` of the ``bergson build`` process) on a loaded shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.timing import run_timed  # noqa: E402

BERGSON = os.path.join(os.path.dirname(sys.executable), "bergson")


def log(msg: str) -> None:
    print(f"[bergson {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_dir(data_dir: str, seq: int, out: str) -> str:
    from million_data import load_model
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    model = load_model(data_dir, seq)
    cfg = GPT2Config(**{**model.config.to_dict(), "n_positions": 8192})
    big = GPT2LMHeadModel(cfg)
    state = model.state_dict()
    wpe = torch.zeros(8192, state["transformer.wpe.weight"].shape[1])
    wpe[:seq] = state["transformer.wpe.weight"]
    state["transformer.wpe.weight"] = wpe
    big.load_state_dict(state, strict=False)
    big.tie_weights()
    big.save_pretrained(out)
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(data_dir, "tokenizer.json"))
    tok.model_max_length = 8192
    tok.save_pretrained(out)
    return out


def dataset_dir(ids: np.ndarray, out: str) -> str:
    from datasets import Dataset

    Dataset.from_dict({"input_ids": ids.astype(np.int64).tolist()}).save_to_disk(out)
    return out


def build(model: str, data: str, run: str) -> tuple[float, float]:
    shutil.rmtree(run, ignore_errors=True)
    cmd = [BERGSON, "build", run, "--model", model, "--dataset", data, "--projection_dim", "16",
           "--filter_modules", "lm_head", "--loss_reduction", "mean", "--token_batch_size",
           "8192", "--precision", "fp32", "--overwrite"]  # fmt: skip
    res, wall, cpu = run_timed(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"bergson build failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--small", type=int, default=2_048)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--data", default="/work/wt/_data/bench1m")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--nprobe", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--out", default=None)
    ap.add_argument("--query-only", action="store_true", help="reuse the builds, query again")
    a = ap.parse_args()
    torch.set_num_threads(1)
    data_dir = os.path.join(a.data, f"data{a.seq}")
    work = os.path.join(a.data, "bergson")
    os.makedirs(work, exist_ok=True)
    windows = np.load(os.path.join(data_dir, "windows.npy"), mmap_mode="r")
    queries = np.load(os.path.join(data_dir, "queries.npy"))[: a.queries]
    model = model_dir(data_dir, a.seq, os.path.join(work, "model"))
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                f"million_bergson_{a.n}.json")  # fmt: skip
    if a.query_only:  # the builds of an earlier run, the query again
        with open(out) as f:
            res = json.load(f)
        res.update(query(os.path.join(work, f"run_{a.n}"), os.path.join(work, "run_queries"), a))
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        return
    res: dict = {"bergson": _version(), "n": a.n, "small": a.small}
    walls, cpus = {}, {}
    for m in (a.small, a.n):
        ds = dataset_dir(np.asarray(windows[:m]), os.path.join(work, f"ds_{m}"))
        log(f"bergson build on {m} windows")
        walls[m], cpus[m] = build(model, ds, os.path.join(work, f"run_{m}"))
        log(f"  {walls[m]:.1f} s wall, {cpus[m]:.1f} s CPU")
    res["build_wall_s"], res["build_cpu_s"] = walls, cpus
    res["marginal_sps"] = (a.n - a.small) / (walls[a.n] - walls[a.small])
    res["marginal_sps_cpu"] = (a.n - a.small) / (cpus[a.n] - cpus[a.small])
    run = os.path.join(work, f"run_{a.n}")
    res["index_bytes"] = sum(os.path.getsize(os.path.join(p, f))
                             for p, _, fs in os.walk(run) for f in fs)  # fmt: skip
    qds = dataset_dir(queries, os.path.join(work, "ds_queries"))
    qrun = os.path.join(work, "run_queries")
    build(model, qds, qrun)
    res.update(query(run, qrun, a))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


def query(run: str, qrun: str, a) -> dict:
    import faiss
    from bergson.config.config import FaissConfig

    if not hasattr(faiss, "GpuIndex"):  # bergson 2.5.1 checks isinstance(index, faiss.GpuIndex)
        faiss.GpuIndex = type("GpuIndex", (), {})  # faiss-cpu has no such class
    from bergson.data import load_module_gradients
    from bergson.query.attributor import Attributor

    qgrads = load_module_gradients(qrun)
    names = list(qgrads.keys())
    q = {n: torch.from_numpy(np.array(qgrads[n], dtype=np.float32)) for n in names}
    rows = []
    truth = None
    nlist = int(4 * np.sqrt(a.n))
    for factory, probes in (("Flat", [None]), (f"IVF{nlist},Flat", a.nprobe)):
        for nprobe in probes:
            cfg = FaissConfig(index_factory=factory, nprobe=nprobe or 1)
            t0 = time.perf_counter()
            att = Attributor(run, device="cpu", unit_norm=True, faiss_cfg=cfg)
            build_s = time.perf_counter() - t0
            if nprobe is not None:  # a reopened index keeps the nprobe it was built with, and
                # its search() resets each shard's nprobe from faiss_cfg (the nprobe setter of
                # bergson 2.5.1 does not update it), so set the config's
                att.faiss_index.faiss_cfg.nprobe = nprobe
            att.search(q, 10)  # warm-up
            t0 = time.perf_counter()
            _, idx = att.search(q, 10)
            s = time.perf_counter() - t0
            idx = idx.numpy()
            if truth is None:
                truth = idx
            recall = float(np.mean([len(set(idx[i]) & set(truth[i])) / 10
                                    for i in range(len(idx))]))  # fmt: skip
            ms = 1e3 * s / len(idx)
            rows.append({"index": factory, "nprobe": nprobe, "open_or_build_s": build_s,
                         "ms_per_query": ms, "recall_vs_flat": recall})  # fmt: skip
            log(f"query {factory} nprobe={nprobe}: {rows[-1]}")
    return {"query": rows, "modules": list(names)}


def _version() -> str:
    from importlib import metadata

    return metadata.version("bergson")


if __name__ == "__main__":
    main()
