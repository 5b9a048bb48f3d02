"""Where the exact-Hessian adjoint grows on the tracing run: per layer, per token.

    OMP_NUM_THREADS=1 nice -n 19 python -m experiments.benchmark.tracing.hessian_layers [--quick]

Runs the exact-Hessian AdamW-influence row (float32, as the tracing table ran it) on one seed
with the parameter adjoint kept whole at a few updates (:func:`.hessian_check.watched_sweeps`),
and reports, per captured layer, the adjoint's norm relative to the query's (mean over the
facts), and for the tied token embedding the vocabulary rows that hold most of it, with each
token's count in the training documents. On the full configuration the float32 sweep passes
float32's range and the library refuses it; the updates it reached are reported.

Writes ``results/tracing_hessian_layers[-quick][-sSEED].json`` (no seed suffix for seed 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

from experiments.benchmark.tracing import data as tdata  # noqa: E402
from experiments.benchmark.tracing import hessian_check as hc  # noqa: E402
from experiments.benchmark.tracing import run  # noqa: E402


@contextlib.contextmanager
def layer_order(out: dict) -> Any:
    """Within: a trajectory attributor's sweep records in ``out`` its layers (the order of the
    dense rows) and their widths."""
    from dattri_llm.attribution.trajectory import base

    original = base.TrajectoryAttributor.run

    def watched(self: Any, index: Any, layers: list[str], *args: Any, **kwargs: Any) -> Any:
        widths = base.layer_widths(index.load(index.steps[0])[0].gradient, layers)
        out["layers"], out["widths"] = list(layers), [widths[n] for n in layers]
        return original(self, index, layers, *args, **kwargs)

    base.TrajectoryAttributor.run = watched
    try:
        yield
    finally:
        base.TrajectoryAttributor.run = original


def analyse(d: tdata.TracingData, lay: dict, kept: dict, qn: torch.Tensor) -> dict[str, Any]:
    """Per kept update: each layer's adjoint norm / query norm (mean over queries), and the
    embedding rows' share of the adjoint's squared norm by token count."""
    layers, widths = lay["layers"], lay["widths"]
    width = run.MODEL["n_embd"]
    vocab = len(d.vocab)
    counts = torch.bincount(d.docs.flatten(), minlength=vocab)
    fact_tokens = set(d.attribute_ids().tolist()) | {d.vocab[f.entity] for f in d.facts}
    out: dict[str, Any] = {"layers": dict(zip(layers, widths)), "per update": {}}
    for step in sorted(kept):
        parts = dict(zip(layers, kept[step].split(widths, dim=1)))
        entry: dict[str, Any] = {
            "finite": bool(torch.isfinite(kept[step]).all()),
            "layer norm / query norm": {
                n: float((p.norm(dim=1) / qn).mean()) for n, p in parts.items()
            },
        }
        emb = [n for n, w in zip(layers, widths) if w == vocab * width]
        if emb and entry["finite"]:
            rows = parts[emb[0]].reshape(len(qn), vocab, width).pow(2).sum(2).mean(0)  # (vocab,)
            total = float(rows.sum())
            top = torch.argsort(rows, descending=True)[:10].tolist()
            itos = {i: w for w, i in d.vocab.items()}
            entry["embedding"] = {
                "layer": emb[0],
                "share of the layer's squared norm, tokens seen <= 10 times": float(
                    rows[counts <= 10].sum() / total
                ),
                "share held by the 16 fact tokens (entities, attributes)": float(
                    rows[sorted(fact_tokens)].sum() / total
                ),
                "top rows (token, count in the documents, share)": [
                    [itos[i], int(counts[i]), round(float(rows[i]) / total, 4)] for i in top
                ],
            }
        out["per update"][str(step)] = entry
    out["tokens seen <= 10 times"] = int((counts <= 10).sum())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the quick configuration")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dict(run.QUICK if ns.quick else run.FULL)
    t0 = time.perf_counter()
    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], ns.seed
    )
    states = run.train(d, list(range(len(d.docs))), cfg, ns.seed, snapshots=cfg["checkpoints"])
    steps = run.snapshot_steps(len(d.docs), cfg, 1)[-1]
    keep = tuple(sorted({steps - 1, *(steps * k // 16 for k in (12, 8, 4, 2, 1)), 4, 1, 0}))
    ctx = run.trajectory_context(d, states, ns.seed, cfg)
    lay: dict = {}
    record: list[dict] = []
    refused = None
    with layer_order(lay), hc.watched_sweeps(record, keep):
        try:
            hc._method(hc.FLOAT32)(ctx)
        except FloatingPointError as err:
            refused = str(err)
    run.release_contexts()
    if len(record) != 1:
        raise RuntimeError(f"expected one sweep (one query chunk), got {len(record)}")
    result = {
        "command": " ".join(
            ["python -m experiments.benchmark.tracing.hessian_layers", *sys.argv[1:]]
        ),
        "seed": ns.seed,
        "config": cfg,
        "refused": refused,
        **analyse(d, lay, record[0]["kept"], record[0]["query_norm"].double()),
        "wall_s": time.perf_counter() - t0,
        "load_average": os.getloadavg(),
    }
    tag = ("-quick" if ns.quick else "") + (f"-s{ns.seed}" if ns.seed else "")
    path = run.RESULTS / f"tracing_hessian_layers{tag}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
