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

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.benchmark.tracing import data as tdata

#: Part of the retrain cache's key: bump it when the training code changes.
CACHE_VERSION = 1

CARRIERS = "carriers (ground truth)"
FILLED = "carriers + random (same size)"

#: ``(keep) -> (n_facts, vocab)`` log-probabilities of the model retrained on ``keep``; set
#: before the worker processes fork (they inherit it, nothing is pickled to them).
_JOB: Callable[[Any], np.ndarray] | None = None


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


def _run_one(key: Any) -> tuple[Any, np.ndarray, float]:
    assert _JOB is not None
    t0 = time.perf_counter()
    lp = _JOB(key)
    return key, lp, time.perf_counter() - t0


class RetrainCache:
    """Retrained log-probabilities on disk (``<root>/<sha256>.safetensors``, one per removal;
    atomic writes), so that an interrupted seed resumes where it stopped. The key hashes the
    configuration, the model, the seed, the torch version and the removal; the training code
    itself is not in it: bump :data:`CACHE_VERSION` (or delete the folder) when it changes."""

    def __init__(self, root: Path, context: dict) -> None:
        self.root = Path(root)
        self.context = json.dumps({"version": CACHE_VERSION, **context}, sort_keys=True)

    def _path(self, key: tuple[int, ...]) -> Path:
        digest = hashlib.sha256(f"{self.context}|{list(key)}".encode()).hexdigest()
        return self.root / f"{digest[:32]}.safetensors"

    def get(self, key: tuple[int, ...]) -> np.ndarray | None:
        path = self._path(key)
        if not path.exists():
            return None
        from safetensors.numpy import load_file

        try:
            return load_file(str(path))["logp"]
        except Exception as err:
            raise RuntimeError(f"retrain cache file {path} is corrupt: {err}; delete it") from err

    def put(self, key: tuple[int, ...], lp: np.ndarray) -> None:
        from safetensors.numpy import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        save_file({"logp": np.ascontiguousarray(lp)}, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)


def retrain_all(
    keys: list[tuple[int, ...]],
    n_docs: int,
    retrain: Callable[[list[int]], np.ndarray],
    jobs: int = 1,
    log: Callable[[str], None] = print,
    cache: RetrainCache | None = None,
) -> tuple[dict[tuple[int, ...], np.ndarray], list[float]]:
    """``retrain(keep)`` for each distinct removal in ``keys`` (sorted document indices), in
    the order of ``keys``, in ``jobs`` forked processes; returns the log-probabilities per
    removal and each (new) retraining's wall time. Removals found in ``cache`` are not
    retrained; new ones are added to it."""
    global _JOB
    out: dict = {}
    todo = []
    for key in dict.fromkeys(keys):
        hit = cache.get(key) if cache is not None else None
        if hit is None:
            todo.append(key)
        else:
            out[key] = hit
    if out:
        log(f"    {len(out)} removals from the retrain cache, {len(todo)} to retrain")

    def job(key: tuple[int, ...]) -> np.ndarray:
        gone = set(key)
        return retrain([i for i in range(n_docs) if i not in gone])

    _JOB = job
    secs: list[float] = []
    try:
        if jobs == 1:
            results: Any = map(_run_one, todo)
        else:
            pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
            results = pool.map(_run_one, todo)
        for n, (key, lp, s) in enumerate(results, 1):
            out[key] = lp
            secs.append(s)
            if cache is not None:
                cache.put(key, lp)
            if n % 20 == 0 or n == len(todo):
                log(f"    retrained {n}/{len(todo)} ({np.mean(secs):.1f} s each)")
        if jobs > 1:
            pool.shutdown()
    finally:
        _JOB = None
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
