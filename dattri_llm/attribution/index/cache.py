"""The index an :class:`~dattri_llm.Explorer` searches on a large store, cached beside the store.

``Explorer(..., index="auto")`` (``dattri-llm serve``'s default) scans a store of at most
:data:`SCAN_MAX_SAMPLES` samples and :data:`SCAN_MAX_NUMBERS` numbers (samples x numbers per
sample): reading it per query stays within tens of milliseconds. A larger store is searched
through a
:class:`~dattri_llm.GradientIndex` with ``kind="auto"`` (exact ``flat`` while it holds little
memory, IVF with exact re-ranking above; see :mod:`dattri_llm.attribution.index.kinds`), built on
the first start and kept in ``STORE.index/METRIC-DIGEST``, where the digest is that of the store's
content fingerprint (:meth:`~dattri_llm.GradientStorageManager.fingerprint`): a later start on
the same store opens it, a changed store gets a new one and the stale ones are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["SCAN_MAX_NUMBERS", "SCAN_MAX_SAMPLES", "index_directory", "wants_index", "cached_index"]

#: ``index="auto"`` scans a store of at most this many numbers (40 MB of float32) and
#: :data:`SCAN_MAX_SAMPLES` samples; above either, it searches an index. A scan reads, decodes
#: and normalizes every record per query (~0.1 ms per sample even when narrow, more when wide:
#: docs/benchmarks/serve.md), where a flat index holds the unit vectors in memory.
SCAN_MAX_NUMBERS = 10_000_000
#: See :data:`SCAN_MAX_NUMBERS`.
SCAN_MAX_SAMPLES = 500


def index_directory(store_dir: str | os.PathLike, metric: str, fingerprint: dict) -> Path:
    """Where the cached index of ``metric`` over a store of content ``fingerprint`` lives."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    store = Path(os.path.abspath(store_dir))
    return store.with_name(store.name + ".index") / f"{metric}-{digest}"


def wants_index(num_samples: int, dim: int) -> bool:
    """Whether ``index="auto"`` searches an index over ``num_samples`` vectors of ``dim``."""
    return num_samples > SCAN_MAX_SAMPLES or num_samples * dim > SCAN_MAX_NUMBERS


def cached_index(
    store_dir: str | os.PathLike,
    metric: str,
    *,
    show_progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """The ``kind="auto"`` index of ``metric`` over a store: opened if cached, else built.

    Args:
        store_dir: The store directory.
        metric: ``"cosine"`` (Grad-Cos) or ``"dot"`` (Grad-Dot).
        show_progress: The build's progress bar (``None``: only on a terminal).
        log: Told, in one line, whether the index was opened or built and where.

    Returns:
        The opened :class:`~dattri_llm.GradientIndex`.
    """
    from dattri_llm.attribution.index import GradientIndex, IndexFormatError, StaleIndexError
    from dattri_llm.attribution.index.format import META_NAME
    from dattri_llm.gradient.store import GradientStorageManager

    say = log or (lambda _: None)
    store = GradientStorageManager(os.fspath(store_dir))
    where = index_directory(store_dir, metric, store.fingerprint())
    if (where / META_NAME).is_file():
        try:
            index = GradientIndex.open(where, store=store)
            say(f"opened the {index.kind} index {where}")
            return index
        except (IndexFormatError, StaleIndexError):
            pass  # damaged or interrupted: built again below
    where.parent.mkdir(parents=True, exist_ok=True)
    # built aside and renamed whole: a server started meanwhile never opens a partial index
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"building an index of {store.num_samples} samples into {where} (once per store)")
    try:
        GradientIndex.build(
            store, tmp, metric=metric, kind="auto", overwrite=True, show_progress=show_progress
        )
        shutil.rmtree(where, ignore_errors=True)
        os.replace(tmp, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in where.parent.glob(f"{metric}-*"):
        if stale != where:  # indexes of the store's earlier content: never valid again
            shutil.rmtree(stale, ignore_errors=True)
    index = GradientIndex.open(where, store=store)
    say(f"built the {index.kind} index {where}")
    return index
