"""The weights each checkpoint label of a store stands for (``checkpoints.json``).

Every record carries a fingerprint of the weights it was captured at
(:mod:`dattri_llm.gradient.hooks.fingerprint`). A label captured at fixed weights (one
fingerprint over all its records) stands for those weights. A label captured *while training*
(the records of one epoch, or of the steps between two saves) spans several weights; the
capture then declares which weights the label stands for — those at the end of its interval,
where the checkpoint is saved and where its queries are captured — in ``checkpoints.json`` at
the store's root::

    {"checkpoints": {"0": {"weights_fingerprint": "0:0x1.8p+3", "global_step": 4,
                           "epoch": 1.0, "reason": "epoch"}, ...},
     "per_sample_loss": "sum"}

The score loop reads it to refuse a query store captured at weights that match none of the
train labels it is scored against, and to know that a declared label spans a training interval
on purpose (no "captured at different weights" warning for it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY as FINGERPRINT_KEY
from dattri_llm.gradient.store.format import decode_json
from dattri_llm.utils.files import atomic_write

__all__ = [
    "CHECKPOINTS_FILE",
    "read_checkpoints_file",
    "declare_checkpoint",
    "declare_capture",
    "declared_labels",
    "label_weights",
]

CHECKPOINTS_FILE = "checkpoints.json"


def read_checkpoints_file(directory: str | os.PathLike) -> dict[str, Any]:
    """The store's ``checkpoints.json`` (``{}`` when it has none)."""
    path = Path(directory) / CHECKPOINTS_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object; remove it or rewrite the store.")
    return data


def _write(directory: Path, data: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write(directory / CHECKPOINTS_FILE, json.dumps(data, indent=1, sort_keys=True), True)


def declare_checkpoint(
    directory: str | os.PathLike, label: int, fingerprint: str, **info: Any
) -> None:
    """Record that checkpoint ``label`` of the store stands for the weights ``fingerprint``.

    Args:
        directory: The store's root.
        label: The checkpoint label (``HookManager.checkpoint`` of its records).
        fingerprint: ``weights_fingerprint`` of the weights the label stands for.
        **info: JSON-serialisable facts kept beside it (``global_step``, ``epoch``, ...).
    """
    directory = Path(directory)
    data = read_checkpoints_file(directory)
    data.setdefault("checkpoints", {})[str(int(label))] = {
        "weights_fingerprint": fingerprint,
        **info,
    }
    _write(directory, data)


def declare_capture(directory: str | os.PathLike, **facts: Any) -> None:
    """Record capture-wide facts (e.g. ``per_sample_loss``) in ``checkpoints.json``."""
    directory = Path(directory)
    data = read_checkpoints_file(directory)
    data.update(facts)
    _write(directory, data)


def declared_labels(directory: str | os.PathLike) -> dict[int, str]:
    """``{label: fingerprint}`` of the labels ``checkpoints.json`` declares."""
    entries = read_checkpoints_file(directory).get("checkpoints", {})
    return {int(k): str(v["weights_fingerprint"]) for k, v in entries.items()}


def label_weights(
    store: Any, checkpoints: Iterable[int] | None = None
) -> dict[int, set[str] | None]:
    """``{label: the fingerprints of the weights it stands for}``; ``None`` where unknown.

    A declared label stands for its declared weights; an undeclared one for the one fingerprint
    its records share. An undeclared label whose records carry several fingerprints (a loop
    that trained while it captured) or none (records written without a hook manager) is
    unknown.

    Args:
        store: A :class:`~dattri_llm.GradientStorageManager`.
        checkpoints: Only these labels (default: all).
    """
    wanted = None if checkpoints is None else {int(c) for c in checkpoints}
    seen: dict[int, set[str | None]] = {}
    for _, entry in store.index_entries():
        label = int(entry["checkpoint"])
        if wanted is not None and label not in wanted:
            continue
        fingerprint = decode_json(entry.get("metadata", {})).get(FINGERPRINT_KEY)
        seen.setdefault(label, set()).add(fingerprint if isinstance(fingerprint, str) else None)
    declared = declared_labels(store.save_dir)
    out: dict[int, set[str] | None] = {}
    for label, fingerprints in seen.items():
        if label in declared:
            out[label] = {declared[label]}
        elif len(fingerprints) == 1 and None not in fingerprints:
            out[label] = {str(f) for f in fingerprints}
        else:
            out[label] = None
    return out
