"""The causal check of the fact-tracing benchmark: one same-size removal per row and fact.

The model is retrained (same initialisation and batch order) without exactly a row's top-``k``
documents for a fact; the drop is ``log p_full(a) − log p_removed(a)`` under the fact's query.
Identical removals share one retraining; ``jobs`` forked processes give the same result.
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

#: ``(removal) -> (n_facts, vocab)`` log-probabilities; set before the workers fork (they
#: inherit it, nothing is pickled to them).
_JOB: Callable[[Any], np.ndarray] | None = None


def control_removals(d: tdata.TracingData, k: int, seed: int) -> dict[str, list[list[int]]]:
    """Per fact: its carriers, and its carriers padded to ``k`` with random documents that
    carry no fact (seeded by ``seed`` and the fact: the same-size removal)."""
    carrying = {i for f in d.facts for i in f.docs}
    plain = [i for i in range(len(d.docs)) if i not in carrying]
    filled = []
    for q, f in enumerate(d.facts):
        rng = np.random.default_rng([3000, seed, q])
        filled.append(
            sorted([*f.docs, *rng.choice(plain, k - len(f.docs), replace=False).tolist()])
        )
    return {CARRIERS: [sorted(f.docs) for f in d.facts], FILLED: filled}


def _run_one(key: Any) -> tuple[Any, np.ndarray, float]:
    t0 = time.perf_counter()
    lp = _JOB(key)  # type: ignore[misc]
    return key, lp, time.perf_counter() - t0


def retrain_all(
    keys: list[tuple[int, ...]],
    n_docs: int,
    retrain: Callable[[list[int]], np.ndarray],
    jobs: int = 1,
    log: Callable[[str], None] = print,
) -> tuple[dict[tuple[int, ...], np.ndarray], list[float]]:
    """``retrain(keep)`` once per distinct removal in ``keys``: log-probabilities per removal
    and each retraining's wall time."""
    global _JOB
    todo = list(dict.fromkeys(keys))
    _JOB = lambda key: retrain([i for i in range(n_docs) if i not in set(key)])  # noqa: E731
    out, secs = {}, []
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
    try:
        for n, (key, lp, s) in enumerate((pool.map if jobs > 1 else map)(_run_one, todo), 1):
            out[key] = lp
            secs.append(s)
            if n % 20 == 0 or n == len(todo):
                log(f"    retrained {n}/{len(todo)} ({np.mean(secs):.1f} s each)")
    finally:
        pool.shutdown()
        _JOB = None
    return out, secs


def drops(
    removals: dict[str, list[list[int]]],
    lps: dict[tuple[int, ...], np.ndarray],
    base: torch.Tensor,
    attrs: torch.Tensor,
) -> dict[str, list[float]]:
    """Per row and fact ``q``: ``base[q] − log p(a_q)`` retrained without the row's removal."""
    return {
        name: [
            float(base[q]) - float(lps[tuple(sorted(r))][q, int(attrs[q])])
            for q, r in enumerate(rem)
        ]
        for name, rem in removals.items()
    }
