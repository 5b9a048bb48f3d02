"""Resumable scoring: the score loop's partial result, checkpointed per train block.

With ``AttributionArguments(resumable=True)``, ``attribute_from_cache`` (and
``attribute_sources`` over a store) writes, after every scored train block, what it has so far
under ``output_dir/scoring_checkpoints/<key>/rank_<r>_of_<w>/``:

* full matrix: one part per block, ``part_<j>.safetensors`` (the block's score rows) and
  ``part_<j>.json`` (their identities, steps, checkpoints);
* ``top_k=``: the whole streamed state, ``state_<j>.safetensors`` + ``.json`` (``O(M·k)``);
* ``progress.json``: the call's fingerprint, how many train records are done and which
  files hold them. It is replaced last (write to a temporary file, fsync, rename), so a kill at
  any moment leaves either the previous checkpoint or the new one, never a torn one; files no
  ``progress.json`` names are leftovers of an interrupted write and are removed on resume.

``<key>`` is a digest of the *fingerprint*: the attributor and its settings, the call's options
(granularity, ``top_k``, layers, checkpoints), the train records covered (store and its content
fingerprint, record identities, rows) and the prepared test gradients (a digest of their
values), and the rank and world size. Re-running the same call after a kill finds the same
key, loads the parts, skips the records they cover and scores the rest; any change of those
inputs gives another key (a fresh run), so a resumed result is the uninterrupted one. The
directory is removed when the call returns its result. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dattri_llm.utils.files import atomic_write, fsync_dir

__all__ = ["ScoreCheckpoint", "tensor_digest", "settings_of", "checkpoint_for"]

_ROOT = "scoring_checkpoints"
_PROGRESS = "progress.json"


def tensor_digest(tensors: list[torch.Tensor]) -> str:
    """A cheap digest of tensor values: shapes, dtypes, float64 sums and a strided sample."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
        if t.numel() == 0:
            continue
        flat = t.reshape(-1)
        if flat.is_floating_point():
            d = flat.to(torch.float64)
            h.update(f"{float(d.sum())!r}|{float(d.abs().sum())!r}|".encode())
        step = max(1, flat.numel() // 4096)
        sample = flat[::step].to("cpu").contiguous()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def settings_of(obj: Any) -> dict[str, Any]:
    """The JSON-able settings of an attributor (what its scores depend on besides the data).

    Public attributes (and the per-call state ``_call*``) are kept; the task, the run options
    and non-JSON values (fits, callables) are replaced by their ``repr`` — an object's ``repr``
    usually holds its address, which makes a resumed run start afresh rather than mix.
    """
    out: dict[str, Any] = {}
    for k, v in sorted(vars(obj).items()):
        if k in ("task", "args", "factors") or (k.startswith("_") and not k.startswith("_call")):
            continue
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out


class ScoreCheckpoint:
    """The checkpoint directory of one scoring call on one rank.

    Args:
        output_dir: ``AttributionArguments.output_dir``.
        fingerprint: JSON-able description of the call (see the module docstring).
        rank, world: This process's rank and the world size.
    """

    def __init__(self, output_dir: str | os.PathLike, fingerprint: dict, rank: int, world: int):
        blob = json.dumps(fingerprint, sort_keys=True, default=repr)
        self.key = hashlib.sha256(blob.encode()).hexdigest()[:20]
        self.fingerprint = json.loads(blob)
        self.root = Path(output_dir) / _ROOT / self.key
        self.dir = self.root / f"rank_{rank}_of_{world}"
        self.files: list[str] = []  # the files progress.json names
        self.units_done = 0
        self._next = 0

    # ---- resume ----
    def resume(self, sink: Any) -> int:
        """Load a previous run's checkpoint into ``sink``; return the records it covers."""
        from safetensors.torch import load_file

        from dattri_llm.attribution.engine.sinks import FullSink

        path = self.dir / _PROGRESS
        if not path.is_file():
            return 0
        try:
            progress = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"{path} is damaged ({e}); delete {self.dir} to score from the start."
            ) from None
        if progress.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"{path} was written by another scoring call (fingerprint mismatch under the "
                f"same key); delete {self.dir} to score from the start."
            )
        files = list(progress["files"])
        for name in files:
            stem = self.dir / name
            try:
                tensors = load_file(str(stem) + ".safetensors")
                meta = json.loads(Path(str(stem) + ".json").read_text())
            except Exception as e:  # noqa: BLE001 - any unreadable part is the same error
                raise ValueError(
                    f"checkpoint part {stem}.safetensors/.json is unreadable ({e}); delete "
                    f"{self.dir} to score from the start."
                ) from None
            if isinstance(sink, FullSink):
                sink.add_part(tensors, meta)
            else:
                sink.load_state(tensors, meta)
        for p in self.dir.iterdir():  # leftovers of a write the kill interrupted
            if p.name != _PROGRESS and p.name.split(".")[0] not in files:
                p.unlink(missing_ok=True)
        self.files = files
        self.units_done = int(progress["units_done"])
        self._next = int(progress.get("next", len(files)))
        return self.units_done

    # ---- save ----
    def save(self, sink: Any, units_done: int) -> None:
        """Checkpoint ``sink`` after ``units_done`` records (atomic)."""
        from safetensors.torch import save

        from dattri_llm.attribution.engine.sinks import FullSink

        if isinstance(sink, FullSink):
            part = sink.take_new()
            old: list[str] = []
        else:
            part = sink.state()
            old = list(self.files)
        if part is None and units_done == self.units_done:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        files = list(self.files) if isinstance(sink, FullSink) else []
        if part is not None:
            name = f"{'part' if isinstance(sink, FullSink) else 'state'}_{self._next:06d}"
            self._next += 1
            tensors, meta = part
            atomic_write(self.dir / f"{name}.safetensors", save(dict(tensors)), fsync=True)
            atomic_write(self.dir / f"{name}.json", json.dumps(meta), fsync=True)
            files.append(name)
        progress = {
            "fingerprint": self.fingerprint,
            "units_done": int(units_done),
            "files": files,
            "next": self._next,
        }
        atomic_write(self.dir / _PROGRESS, json.dumps(progress), fsync=True)
        fsync_dir(self.dir)
        for name in old:  # a top-k state replaces the previous one
            if name not in files:
                for ext in (".safetensors", ".json"):
                    (self.dir / (name + ext)).unlink(missing_ok=True)
        self.files = files
        self.units_done = int(units_done)

    def finish(self) -> None:
        """Remove this rank's checkpoint (the call returned its result)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in (self.root, self.root.parent):
            try:
                d.rmdir()  # only when empty (other ranks may still hold theirs)
            except OSError:
                break


def checkpoint_for(
    attributor: Any,
    units: Any,
    test_chunks: list[list[tuple[Any, torch.Tensor]]],
    granularity: str,
    k: int | None,
    columns: list[str],
) -> ScoreCheckpoint:
    """The checkpoint of one scoring call: its key covers what the result depends on."""
    from dattri_llm.attribution.engine.units import unit_digest
    from dattri_llm.gradient.gradient import Materialized, Shared
    from dattri_llm.utils.distributed import get_rank, get_world_size

    tensors = []
    for chunks in test_chunks:
        for grad, cols in chunks:
            for lg in grad.layers.values():
                for site in lg.sites if isinstance(lg, Shared) else [lg]:
                    tensors += [site.data] if isinstance(site, Materialized) else [site.a, site.g]
            tensors.append(cols)
    fingerprint = {
        "attributor": f"{type(attributor).__module__}.{type(attributor).__qualname__}",
        "settings": settings_of(attributor),
        "mode": attributor.mode,
        "granularity": granularity,
        "top_k": k,
        "train": unit_digest(units),
        "test": tensor_digest(tensors),
        "columns": columns,
    }
    return ScoreCheckpoint(attributor.args.output_dir, fingerprint, get_rank(), get_world_size())
