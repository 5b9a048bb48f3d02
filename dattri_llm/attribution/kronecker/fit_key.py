"""What a Fisher fit depends on: the key under which one fit serves several calls.

A K-FAC / EK-FAC / projected-Fisher fit is kept by the attributor and reused by a later call only
when that call's key equals the fit's: the training data it reads *and* the fit's own settings.
The data part is

* a gradient store: its directory, its content (:meth:`GradientStorageManager.fingerprint`:
  an appended, removed or overwritten record changes it), the layers and the checkpoint labels
  (or the records of a rank's share) read;
* a live dataset: the dataset object, its length, the hook config, the task, and the weights the
  task scores at (each parameter's in-place version counter and a sampled fingerprint of its
  values; for a task with checkpoints, the checkpoints: a file's path, size and modification
  time, a state dict's tensors alike);
* a list of in-memory gradient blocks: the list and every tensor in it, with the tensors'
  in-place version counters;
* anything else (a user's gradient source, which may yield other gradients on each pass): no
  key, so it is fitted anew by every call.

Objects are compared by identity and held by the key, so an id cannot be reused meanwhile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dattri_llm.attribution.engine.units import RecordSource
from dattri_llm.gradient.gradient import Gradient, GradientBlock, GradientRecord, Shared
from dattri_llm.gradient.hooks.fingerprint import weights_fingerprint
from dattri_llm.gradient.sources import BlockSource, store_reading
from dattri_llm.gradient.store import GradientStorageManager

__all__ = ["Same", "data_key", "live_key", "store_key"]


class Same:
    """An object compared by identity (and held, so its id stays its own)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"Same({type(self.obj).__name__}@{id(self.obj):#x})"


def store_key(
    store: Any, layers: Iterable[str] | None, checkpoints: Iterable[int] | None, units: Any = None
) -> tuple:
    """The key of a store's records: directory, content fingerprint, layers, labels, units."""
    return (
        "store",
        os.path.realpath(store.save_dir),
        json.dumps(store.fingerprint(), sort_keys=True),
        None if layers is None else tuple(layers),
        None if checkpoints is None else tuple(sorted(int(c) for c in checkpoints)),
        units,
    )


def _tensor_versions(tensors: Iterable[torch.Tensor]) -> tuple:
    return tuple((Same(t), t._version) for t in tensors)


def _gradient_tensors(gradient: Gradient) -> list[torch.Tensor]:
    out = []
    for lg in gradient.layers.values():
        for site in lg.sites if isinstance(lg, Shared) else [lg]:
            for name in ("data", "a", "g"):
                t = getattr(site, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


def _blocks_key(items: list | tuple) -> tuple | None:
    """A list of blocks / records / gradients: the list, its tensors and their versions."""
    tensors, labels = [], []
    for item in items:
        if isinstance(item, Gradient):
            gradient, label = item, 0
        elif isinstance(item, (GradientBlock, GradientRecord)):
            gradient, label = item.gradient, item.checkpoint
        elif isinstance(item, tuple) and len(item) >= 3 and isinstance(item[1], Gradient):
            gradient, label = item[1], item[3] if len(item) > 3 else 0
        else:
            return None
        tensors += _gradient_tensors(gradient)
        labels.append(int(label))
    return ("blocks", Same(items), len(items), tuple(labels), _tensor_versions(tensors))


def _weights_key(params: Mapping[str, torch.Tensor]) -> tuple:
    """Parameters by identity and in-place version, and a sampled fingerprint of their values."""
    tensors = [p for p in params.values() if isinstance(p, torch.Tensor)]
    return (_tensor_versions(tensors), weights_fingerprint({"": dict(params)}))


def _checkpoint_key(ckpt: Any) -> Any:
    if isinstance(ckpt, (str, os.PathLike)):
        path = os.path.realpath(ckpt)
        try:
            st = os.stat(path)
        except OSError:
            return ("file", path, None)
        return ("file", path, st.st_size, st.st_mtime_ns)
    if isinstance(ckpt, Mapping):
        tensors = {str(k): v for k, v in ckpt.items() if isinstance(v, torch.Tensor)}
        return ("state", Same(ckpt), _weights_key(tensors))
    return ("object", Same(ckpt))


def live_key(dataset: Any, hook_config: Any, task: Any) -> tuple:
    """The key of a live fit: the dataset, hook config and task, and the weights scored."""
    if task is None:
        weights = None
    elif getattr(task, "checkpoints", None) is None:
        weights = _weights_key(dict(task.model.named_parameters()))
    else:
        weights = tuple(_checkpoint_key(c) for c in task.checkpoints)
    size = len(dataset) if hasattr(dataset, "__len__") else None
    return ("live", Same(dataset), size, Same(hook_config), Same(task), weights)


def data_key(source: Any) -> tuple | None:
    """The key of the training data a stored fit reads (``None``: not reusable).

    Args:
        source: A store (directory or manager), a source over one (``DiskGradientSource``, a
            rank's share of records), or a list of in-memory blocks.
    """
    if isinstance(source, BlockSource):
        source = source.source  # a user source, as attribute_sources reads it
    if isinstance(source, (str, os.PathLike)):
        return store_key(GradientStorageManager(source), None, None)
    if isinstance(source, GradientStorageManager):
        return store_key(source, None, None)
    if isinstance(source, RecordSource):  # a rank's share of a store
        units = tuple((u.index, None if u.rows is None else tuple(u.rows)) for u in source.units)
        return store_key(source.store, source.layers, None, units)
    reading = store_reading(source)
    if reading is not None:
        return store_key(reading.store, reading.layers, reading.checkpoints)
    if isinstance(source, (list, tuple)) and source:
        return _blocks_key(source)
    return None
