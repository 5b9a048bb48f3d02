"""``TrajectorySnapshots``: a training trajectory on disk (parameters, batches, optimizer dynamics).

A directory beside the gradient store, with the store's rules: tensors in safetensors (read
memory-mapped), metadata in JSON, never a pickle; every file written to a temp name, fsynced,
renamed, then indexed, so a crash leaves every completed entry readable and the directory
re-openable; a file whose size or CRC-32 disagrees with the index raises an error naming it.

Layout (``docs/STORE_FORMAT.md``, section "Trajectory snapshots")::

    meta.json          {"format": "dattri_llm.trajectory", "version": 1}
    index.jsonl        one line per entry: seq, kind, step, file, bytes, crc32, meta
    parameters/        θ_t each recorded step ran from          (kind "parameters")
    batch/             the batch of each step                   (kind "batch")
    dynamics/          optimizer moments before / after a step  (kind "dynamics")
    layout/            how dynamics tensors map to parameters   (kind "layout", step -1)

An entry is one ``(kind, step)``; writing the same one twice is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dattri_llm.gradient.store.format import StoreFormatError, file_crc32
from dattri_llm.gradient.store.index import IndexAppender, parse_index
from dattri_llm.gradient.store.writer import write_shard
from dattri_llm.utils.files import atomic_write

__all__ = ["TrajectorySnapshots", "TRAJECTORY_FORMAT", "TRAJECTORY_VERSION"]

TRAJECTORY_FORMAT = "dattri_llm.trajectory"
TRAJECTORY_VERSION = 1
KINDS = ("parameters", "batch", "dynamics", "layout")
_FIELDS: dict[str, type] = {
    "seq": int,
    "kind": str,
    "step": int,
    "file": str,
    "bytes": int,
    "crc32": int,
    "meta": dict,
}


class TrajectorySnapshots:
    """Read and write a training trajectory in ``root``.

    Writing creates the directory; opening an existing one resumes it (entries already there
    stay, unfinished files of a killed writer are removed). One writer at a time.

    Args:
        root: The directory.
        fsync: fsync every file and index line (turn off only for scratch trajectories).

    Example:
        ```python
        snaps = TrajectorySnapshots("./run/trajectory")
        for step, batch in enumerate(loader):
            snaps.save_batch(step, batch)          # dict of tensors, tensor, or tuple
            loss_fn(model, batch).backward(); opt.step()
        ```
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"trajectory root {self.root} exists and is not a directory.")
        self.fsync = fsync
        self._entries: dict[tuple[str, int], dict] = {}
        self._appender: IndexAppender | None = None
        self._seq = 0
        self._verified: set[str] = set()
        if (self.root / "meta.json").exists():
            self._read_meta()
            self._load_index()
        elif self.root.is_dir() and any(not p.name.startswith(".") for p in self.root.iterdir()):
            raise StoreFormatError(
                f"{self.root} is not a trajectory directory (no meta.json) but is not empty; pass "
                "a new directory or one TrajectorySnapshots wrote."
            )

    # ---- format ----------------------------------------------------------------------------
    def _read_meta(self) -> None:
        path = self.root / "meta.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StoreFormatError(f"{path} is corrupted: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != TRAJECTORY_FORMAT:
            raise StoreFormatError(f"{path} does not describe a dattri_llm trajectory.")
        version = meta.get("version")
        if not isinstance(version, int) or not 1 <= version <= TRAJECTORY_VERSION:
            raise StoreFormatError(
                f"{path} has trajectory format version {version!r}; this dattri_llm reads 1.."
                f"{TRAJECTORY_VERSION}. Upgrade dattri_llm."
            )

    def _index_path(self) -> Path:
        return self.root / "index.jsonl"

    def _load_index(self, warn: bool = True) -> int:
        entries, end, _ = parse_index(self._index_path(), warn=warn, check=_check_line)
        for lineno, entry in enumerate(entries, 1):
            key = (entry["kind"], entry["step"])
            if key in self._entries:
                raise StoreFormatError(
                    f"{self._index_path()}:{lineno}: a second {entry['kind']!r} entry for step "
                    f"{entry['step']}; the index is corrupted."
                )
            self._entries[key] = entry
            self._seq = max(self._seq, entry["seq"] + 1)
        return end

    def _writer(self) -> IndexAppender:
        if self._appender is not None:
            return self._appender
        self.root.mkdir(parents=True, exist_ok=True)
        meta = self.root / "meta.json"
        if not meta.exists():
            atomic_write(
                meta,
                json.dumps({"format": TRAJECTORY_FORMAT, "version": TRAJECTORY_VERSION}) + "\n",
            )
        self._entries.clear()
        valid = self._load_index(warn=False)  # a torn line was reported on opening
        referenced = {e["file"] for e in self._entries.values()}
        for kind in KINDS:
            d = self.root / kind
            if d.is_dir():
                for p in d.iterdir():
                    if p.name.startswith(".") or f"{kind}/{p.name}" not in referenced:
                        p.unlink()  # a killed writer's unfinished file
        self._appender = IndexAppender(self._index_path(), valid, fsync=self.fsync)
        return self._appender

    # ---- writing -----------------------------------------------------------------------------
    def _write(self, kind: str, step: int, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        appender = self._writer()
        step = int(step)
        if (kind, step) in self._entries:
            raise ValueError(
                f"{self.root}: a {kind!r} entry for step {step} exists already; a trajectory "
                "records each step once (use a new directory for a new run)."
            )
        json.dumps(meta, allow_nan=False)  # fail before anything is written
        d = self.root / kind
        d.mkdir(exist_ok=True)
        seq = self._seq
        self._seq += 1
        name, crc, size = write_shard(d, seq, {k: _cpu(v) for k, v in tensors.items()}, self.fsync)
        entry = {
            "seq": seq,
            "kind": kind,
            "step": step,
            "file": f"{kind}/{name}",
            "bytes": size,
            "crc32": crc,
            "meta": meta,
        }
        appender.append(entry)
        self._entries[(kind, step)] = entry

    def save_parameters(
        self,
        step: int,
        parameters: Mapping[str, torch.Tensor],
        rng: Mapping[str, torch.Tensor] | None = None,
        meta: dict | None = None,
    ) -> None:
        """Record the parameters step ``step`` ran from (each in its own dtype).

        Args:
            step: The step (the gradient store's step label).
            parameters: ``{parameter name: tensor}``.
            rng: Random-number-generator states to restore when replaying the step (dropout).
            meta: JSON metadata (e.g. ``{"learning_rate": ...}``).
        """
        tensors = {f"param.{k}": v for k, v in parameters.items()}
        tensors.update({f"rng.{k}": v for k, v in (rng or {}).items()})
        self._write("parameters", step, tensors, dict(meta or {}))

    def save_batch(self, step: int, batch: Any) -> None:
        """Record the batch of step ``step``: a tensor, a dict of tensors, or a tuple / list.

        Non-tensor values of a dict (ints, strings, ...) are kept in the JSON metadata.
        """
        tensors, structure = _encode_batch(batch)
        self._write("batch", step, tensors, {"structure": structure})

    def save_dynamics(self, step: int, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Record one step's optimizer dynamics (see ``OptimizerStateCallback``)."""
        self._write("dynamics", step, tensors, meta)

    def save_layout(self, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Record how dynamics tensors map onto parameters (once per trajectory)."""
        self._write("layout", -1, tensors, meta)

    def close(self) -> None:
        """Close the index (the trajectory stays readable; writing reopens it)."""
        if self._appender is not None:
            self._appender.close()
            self._appender = None

    # ---- reading -----------------------------------------------------------------------------
    def steps(self, kind: str = "parameters") -> list[int]:
        """The recorded steps of one kind, ascending."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
        return sorted(s for k, s in self._entries if k == kind)

    def has(self, kind: str, step: int) -> bool:
        """Whether an entry of ``kind`` exists for ``step``."""
        return (kind, int(step)) in self._entries

    def meta(self, kind: str, step: int) -> dict:
        """The JSON metadata of one entry."""
        return dict(self._entry(kind, step)["meta"])

    def _entry(self, kind: str, step: int) -> dict:
        entry = self._entries.get((kind, int(step)))
        if entry is None:
            have = self.steps(kind)
            raise KeyError(
                f"{self.root} holds no {kind!r} entry for step {step}; recorded steps: "
                f"{have[:20]}{' ...' if len(have) > 20 else ''}."
            )
        return entry

    def _load(self, kind: str, step: int, device: str | torch.device = "cpu") -> dict:
        entry = self._entry(kind, step)
        path = self.root / entry["file"]
        if not path.is_file():
            raise StoreFormatError(f"{path} is missing although {self._index_path()} lists it.")
        if path.stat().st_size != entry["bytes"]:
            raise StoreFormatError(
                f"{path} is truncated or corrupted: {path.stat().st_size} bytes, the index "
                f"recorded {entry['bytes']}."
            )
        if entry["file"] not in self._verified:
            if file_crc32(path) != entry["crc32"]:
                raise StoreFormatError(f"{path} is corrupted: its CRC-32 does not match the index.")
            self._verified.add(entry["file"])
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        except (SafetensorError, OSError) as e:
            raise StoreFormatError(f"{path} is corrupted: {e}") from None

    def load_parameters(
        self, step: int, device: str | torch.device = "cpu"
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(parameters, rng states)`` recorded for ``step``."""
        t = self._load("parameters", step, device)
        params = {k[len("param.") :]: v for k, v in t.items() if k.startswith("param.")}
        rng = {k[len("rng.") :]: v.cpu() for k, v in t.items() if k.startswith("rng.")}
        return params, rng

    def load_batch(self, step: int, device: str | torch.device = "cpu") -> Any:
        """The batch recorded for ``step``, in the structure it was saved with."""
        tensors = self._load("batch", step, device)
        return _decode_batch(tensors, self._entry("batch", step)["meta"]["structure"])

    def load_dynamics(self, step: int, device: str | torch.device = "cpu") -> dict:
        """The tensors of one step's dynamics (``meta("dynamics", step)`` has the rest)."""
        return self._load("dynamics", step, device)

    def load_layout(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The dynamics layout: ``(tensors, meta)``."""
        return self._load("layout", -1), self.meta("layout", -1)

    def learning_rates(self) -> dict[int, float]:
        """``{step: learning rate}`` from the recorded dynamics or parameter metadata."""
        out: dict[int, float] = {}
        for (kind, step), e in sorted(self._entries.items(), key=lambda kv: kv[0][1]):
            lr = e["meta"].get("learning_rate")
            if kind in ("dynamics", "parameters") and isinstance(lr, (int, float)):
                out.setdefault(step, float(lr))
        return out

    def __repr__(self) -> str:
        counts = {k: len(self.steps(k)) for k in KINDS if self.steps(k)}
        return f"TrajectorySnapshots({str(self.root)!r}, {counts})"

    def __enter__(self) -> TrajectorySnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_line(entry: Any, path: Path, lineno: int) -> dict:
    """Validate one trajectory index line (``parse_index``'s checker)."""
    bad = [
        k
        for k, t in _FIELDS.items()
        if not isinstance(entry, dict)
        or not isinstance(entry.get(k), t)
        or (t is int and isinstance(entry.get(k), bool))
    ]
    if bad or entry["kind"] not in KINDS or ".." in Path(entry["file"]).parts:
        raise StoreFormatError(f"{path}:{lineno}: invalid trajectory index line ({bad}).")
    return entry


def _cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _encode_batch(batch: Any) -> tuple[dict[str, torch.Tensor], Any]:
    if isinstance(batch, torch.Tensor):
        return {"0": batch}, {"type": "tensor", "key": "0"}
    if isinstance(batch, Mapping):
        tensors, fields = {}, {}
        for k, v in batch.items():
            if not isinstance(k, str):
                raise TypeError(f"save_batch: batch keys must be strings, got {k!r}.")
            if isinstance(v, torch.Tensor):
                tensors[f"d.{k}"] = v
                fields[k] = {"type": "tensor"}
            else:
                try:
                    json.dumps(v, allow_nan=False)
                except (TypeError, ValueError):
                    raise TypeError(
                        f"save_batch: batch[{k!r}] is a {type(v).__name__}; only tensors and JSON "
                        "values are recorded (no pickle)."
                    ) from None
                fields[k] = {"type": "json", "value": v}
        return tensors, {"type": "dict", "fields": fields}
    if isinstance(batch, Sequence) and not isinstance(batch, str):
        if not all(isinstance(v, torch.Tensor) for v in batch):
            raise TypeError("save_batch: a tuple / list batch must hold only tensors.")
        kind = "tuple" if isinstance(batch, tuple) else "list"
        return {f"s.{i}": v for i, v in enumerate(batch)}, {"type": kind, "n": len(batch)}
    raise TypeError(
        f"save_batch: batch must be a tensor, a dict or a tuple / list of tensors, got "
        f"{type(batch).__name__}."
    )


def _decode_batch(tensors: dict[str, torch.Tensor], structure: dict) -> Any:
    kind = structure["type"]
    if kind == "tensor":
        return tensors[structure["key"]]
    if kind == "dict":
        return {
            k: tensors[f"d.{k}"] if f["type"] == "tensor" else f["value"]
            for k, f in structure["fields"].items()
        }
    items = [tensors[f"s.{i}"] for i in range(structure["n"])]
    return tuple(items) if kind == "tuple" else items
