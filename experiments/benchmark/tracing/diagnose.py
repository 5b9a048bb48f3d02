"""What the causal drop of a row's removal is made of: its carriers, or the rest of its picks?

A row's causal retraining removes the union of its top-10 documents over the 8 facts: the
carriers it found plus other documents. This script splits that removal, per seed, for the
rows named in ``--rows`` (their names in :func:`.run.methods`):

* ``extras only``: retrain without the row's non-carrier picks alone (the carriers stay);
* ``carriers + random``: retrain without all 24 carriers plus as many random non-carriers as
  the row's union holds (same removal size as the row, the carriers removed on purpose).

Each fact's drop ``log p_full(a) − log p_removed(a)`` as in :mod:`.run` (same initialisation,
same batch-order seed). Run (one process; 1 training per seed, 2 retrainings per seed and row;
204 s wall for 3 rows x 3 seeds here)::

    python -m experiments.benchmark.tracing.diagnose --rows "BM25 (rank-bm25)"

Writes ``experiments/benchmark/results/tracing-diagnose.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from experiments.benchmark.tracing import data as tdata  # noqa: E402
from experiments.benchmark.tracing import metrics as tm  # noqa: E402
from experiments.benchmark.tracing import run  # noqa: E402


def drops(d: tdata.TracingData, cfg: dict, seed: int, gone: set[int], base: torch.Tensor) -> list:
    """Per fact, the attribute's log-probability lost when retrained without ``gone``."""
    keep = [i for i in range(len(d.docs)) if i not in gone]
    lp = run.attribute_logp(run.load(d, run.train(d, keep, cfg, seed)[-1]), d)[0]
    attrs = d.attribute_ids()
    return (base - lp[torch.arange(len(attrs)), attrs]).tolist()


def diagnose_seed(cfg: dict, seed: int, names: list[str]) -> dict:
    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], seed
    )
    states = run.train(d, list(range(len(d.docs))), cfg, seed, snapshots=cfg["checkpoints"])
    lp, _ = run.attribute_logp(run.load(d, states[-1]), d)
    base = lp[torch.arange(len(d.facts)), d.attribute_ids()]
    carriers = {i for f in d.facts for i in f.docs}
    rng = np.random.default_rng(2000 + seed)
    out = {}
    rows = run.methods(False)
    for name in names:
        scores = rows[name](d, states, seed)
        union = {i for t in tm.top_k(scores, cfg["k"]) for i in t}
        extras = union - carriers
        others = sorted(set(range(len(d.docs))) - carriers)
        padding = set(rng.choice(others, len(extras), replace=False).tolist())
        out[name] = {
            "removed": len(union),
            "carriers_found": len(union & carriers),
            "extras": len(extras),
            "extras_only": drops(d, cfg, seed, extras, base),
            "carriers_plus_random": drops(d, cfg, seed, carriers | padding, base),
        }
        m = {k: np.mean(v) for k, v in out[name].items() if isinstance(v, list)}
        print(f"seed {seed} {name}: {len(union)} removed, {len(extras)} extras; {m}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", required=True, help="row names as in run.py")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    known = run.methods(False)
    unknown = sorted(set(ns.rows) - set(known))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; known: {sorted(known)}")
    t0 = time.perf_counter()
    result = {"seeds": {s: diagnose_seed(run.FULL, s, ns.rows) for s in ns.seeds}}
    result["wall_s"] = time.perf_counter() - t0
    for name in ns.rows:
        for key in ("extras_only", "carriers_plus_random"):
            vals = [v for s in result["seeds"].values() for v in s[name][key]]
            m, h = tm.mean_ci(vals)
            print(f"{name}: {key} {m:.3f} ± {h:.3f} nats over {len(vals)} (seed, fact)")
    path = run.RESULTS / "tracing-diagnose.json"
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
