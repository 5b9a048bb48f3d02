"""The causal check of the fact-tracing benchmark: one same-size removal per fact.

For every row and every fact, the model is retrained (same initialisation, same batch-order
seed) without exactly that row's top-``k`` documents for that fact, and the fact's drop is
``log p_full(a) − log p_removed(a)`` under its held-out prompt. Every method row therefore
removes exactly ``k`` documents per fact, whatever the other facts' picks are. Two controls
fix the removal without any retrieval:

* ``carriers (ground truth)``: the fact's planted carriers only (``copies`` documents);
* ``carriers + random (same size)``: the carriers plus ``k − copies`` random documents that
  carry no fact (seeded per seed and fact): the same-size removal a perfect retriever would
  approach.

Identical removal sets share one retraining (deterministic on CPU); the distinct ones can be
retrained in ``jobs`` forked worker processes (the result does not depend on ``jobs``).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import torch

from experiments.benchmark.tracing import data as tdata

CARRIERS = "carriers (ground truth)"
FILLED = "carriers + random (same size)"

#: ``(keep) -> (n_facts, vocab)`` log-probabilities of the model retrained on ``keep``; set
#: before the worker processes fork (they inherit it, nothing is pickled to them).
_RETRAIN: Callable[[list[int]], np.ndarray] | None = None
_N_DOCS = 0


def control_removals(d: tdata.TracingData, k: int, seed: int) -> dict[str, list[list[int]]]:
    """The two control rows' removal per fact: its carriers, and its carriers padded to ``k``
    documents with random documents that carry no fact (seeded by ``seed`` and the fact)."""
    carrying = {i for f in d.facts for i in f.docs}
    plain = [i for i in range(len(d.docs)) if i not in carrying]
    filled = []
    for q, f in enumerate(d.facts):
        if len(f.docs) > k:
            raise ValueError(f"fact {q} has {len(f.docs)} carriers, more than k={k}")
        rng = np.random.default_rng([3000, seed, q])
        pad = rng.choice(plain, k - len(f.docs), replace=False).tolist()
        filled.append(sorted([*f.docs, *pad]))
    return {CARRIERS: [sorted(f.docs) for f in d.facts], FILLED: filled}


def _retrain_one(key: tuple[int, ...]) -> tuple[tuple[int, ...], np.ndarray, float]:
    assert _RETRAIN is not None
    gone = set(key)
    keep = [i for i in range(_N_DOCS) if i not in gone]
    t0 = time.perf_counter()
    lp = _RETRAIN(keep)
    return key, lp, time.perf_counter() - t0


def retrain_all(
    keys: list[tuple[int, ...]],
    n_docs: int,
    retrain: Callable[[list[int]], np.ndarray],
    jobs: int = 1,
    log: Callable[[str], None] = print,
) -> tuple[dict[tuple[int, ...], np.ndarray], list[float]]:
    """``retrain(keep)`` for each distinct removal in ``keys`` (sorted document indices), in
    ``jobs`` forked processes; returns the log-probabilities per removal and each retraining's
    wall time."""
    global _RETRAIN, _N_DOCS
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    todo = list(dict.fromkeys(keys))
    _RETRAIN, _N_DOCS = retrain, n_docs
    out: dict[tuple[int, ...], np.ndarray] = {}
    secs: list[float] = []
    try:
        if jobs == 1:
            results: Any = map(_retrain_one, todo)
        else:
            pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
            results = pool.map(_retrain_one, todo)
        for n, (key, lp, s) in enumerate(results, 1):
            out[key] = lp
            secs.append(s)
            if n % 20 == 0 or n == len(todo):
                log(f"    retrained {n}/{len(todo)} ({np.mean(secs):.1f} s each)")
        if jobs > 1:
            pool.shutdown()
    finally:
        _RETRAIN = None
    return out, secs


def drops(
    removals: dict[str, list[list[int]]],
    lps: dict[tuple[int, ...], np.ndarray],
    base: torch.Tensor,
    attrs: torch.Tensor,
) -> dict[str, list[float]]:
    """Per row, per fact ``q``: ``base[q] − log p(a_q)`` of the model retrained without that
    row's removal for ``q``."""
    return {
        name: [
            float(base[q]) - float(lps[tuple(sorted(r))][q, int(attrs[q])])
            for q, r in enumerate(rem)
        ]
        for name, rem in removals.items()
    }
