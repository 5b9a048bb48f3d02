"""The Kronecker statistics a compact store records, so K-FAC / EK-FAC fit without the factors.

A compact store (``OffloadCallback`` defaults, :mod:`.compact`) writes a layer densely when that
is smaller, and the dense per-sample gradient no longer holds the token factors ``a``, ``g``
that K-FAC's covariances ``A`` and ``G`` are made of. So the writer accumulates, from the
factors of every record it writes, the running sums of :class:`KroneckerCovariances` (the same
accumulator a fit over a factor store uses: ``sum a aᵀ``, ``sum g gᵀ``, token and sample
counts, per layer and checkpoint) and keeps them beside the records, one file per partition:
``(D² + K²) / 2`` numbers per layer (the triangles of the symmetric sums), not per sample.
EK-FAC's eigenvalue correction needs only the per-sample gradients, which every form of the
store holds.

The file, ``kronecker_statistics.safetensors`` in the partition directory, is written whole
(hidden temporary file, fsync, rename) when the writer flushes or closes, merged with what the
partition already held; its header names the records it covers by ``(step, checkpoint, crc32,
bytes)``, so a reader uses the sums only for those records and reads every other record's
factors (a record written without statistics, or after the last save of a killed writer). The
format is specified in ``docs/STORE_FORMAT.md`` ("Kronecker statistics").
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient
from dattri_llm.gradient.kronecker.covariances import (
    KroneckerCovariances,
    is_kronecker_layer,
    layer_sites,
)
from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.store.format import KRONECKER_FILE, StoreFormatError
from dattri_llm.utils.files import atomic_write, fsync_dir

__all__ = [
    "STATISTICS_FORMAT",
    "STATISTICS_VERSION",
    "STATISTICS_TOKENS",
    "StoreStatistics",
    "StatisticsRecorder",
    "statistics_view",
    "read_statistics",
]

#: The format name in the file's header; readers refuse anything else.
STATISTICS_FORMAT = "dattri_llm.kronecker_statistics"
#: The file's format version.
STATISTICS_VERSION = 1
#: The token counting of the recorded sums (``KroneckerCovariances(tokens=...)``).
STATISTICS_TOKENS = "gradient"
_META_KEY = "dattri_llm"

#: ``(step, checkpoint, crc32, bytes)``: a record, as the file names the ones it covers.
RecordKey = tuple[int, int, int, int]


def _needs_factors(lg: object) -> bool:
    """A layer whose K-FAC covariances need its token factors (not a vector layer)."""
    return is_kronecker_layer(lg) and not get_rule(lg.layer_type).exact_fisher


def statistics_view(gradient: Gradient) -> Gradient | None:
    """The layers of a record whose statistics are recorded, or ``None`` if it cannot be.

    Every Kronecker layer that needs its factors (a vector layer's Fisher is read from its
    stored vectors), plus the non-Kronecker layers (only their names are recorded, as
    skipped). ``None`` when such a layer already lost its factors at capture
    (``capture_style`` other than ``"factorized"``): the record is then left uncovered, and a
    fit reads it (and refuses its dense layer, naming the fix).
    """
    keep = {}
    for name, lg in gradient.layers.items():
        if _needs_factors(lg):
            if not all(isinstance(s, Factorized) for s in layer_sites(lg)):
                return None
            keep[name] = lg
        elif not is_kronecker_layer(lg):
            keep[name] = lg
    return Gradient(keep) if keep else None


@dataclass
class StoreStatistics:
    """The Kronecker statistics of a store, merged over its partitions.

    Attributes:
        covariances: ``{checkpoint: KroneckerCovariances}``: the sums over the covered records
            (marked reduced: they already hold every rank's records).
        covered: The covered records, by position in store order.
    """

    covariances: dict[int, KroneckerCovariances] = field(default_factory=dict)
    covered: frozenset[int] = frozenset()


class StatisticsRecorder:
    """The writer's side: sums of the records written since the last save, per checkpoint."""

    def __init__(self) -> None:
        self._covs: dict[int, KroneckerCovariances] = {}
        self._seqs: dict[int, list[int]] = {}

    @property
    def pending(self) -> bool:
        """Whether records were added since the last save."""
        return bool(self._seqs)

    def add(self, seq: int, checkpoint: int, gradient: Gradient) -> None:
        """Add the record ``seq`` (its :func:`statistics_view`) to its checkpoint's sums."""
        cov = self._covs.get(checkpoint)
        if cov is None:
            cov = self._covs[checkpoint] = KroneckerCovariances(tokens=STATISTICS_TOKENS)
        cov.update(gradient)
        self._seqs.setdefault(checkpoint, []).append(seq)

    def discard(self) -> None:
        """Forget the pending sums (their records are then read as uncovered)."""
        self._covs, self._seqs = {}, {}

    def save(self, directory: Path, entries: Sequence[Mapping], fsync: bool = True) -> None:
        """Merge the pending sums into ``directory``'s file (written whole, atomically).

        Args:
            directory: The partition (its writer's lock held).
            entries: The partition's durable index entries (entry ``i`` is ``seq`` ``i``).
            fsync: fsync the file and the directory.
        """
        if not self.pending:
            return
        path = directory / KRONECKER_FILE
        old = _read_file(path) if path.exists() else {}
        for c, cov in self._covs.items():
            keys = []
            for s in self._seqs[c]:
                if entries[s]["seq"] != s:  # never: the index is checked to be in seq order
                    raise RuntimeError(
                        f"{directory}: index entry {s} holds seq {entries[s]['seq']}."
                    )
                keys.append(_key(entries[s]))
            if c in old:
                prev, prev_keys = old[c]
                try:
                    cov = prev.merge(cov)
                except ValueError:
                    # other layers under one label: a store mixing captures, which the
                    # reader's compatibility check refuses by name; no sums are kept for it
                    # (its records read as uncovered), so nothing here hides that refusal
                    del old[c]
                    continue
                keys = prev_keys + keys
            old[c] = (cov, keys)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"format": STATISTICS_FORMAT, "version": STATISTICS_VERSION}
        meta["checkpoints"] = {}
        for c, (cov, keys) in sorted(old.items()):
            t, m = cov.to_bundle()
            t = {k: _pack(v) if k.endswith(_SYMMETRIC) else v for k, v in t.items()}
            tensors.update({f"{c}/{k}": v.detach().cpu().contiguous() for k, v in t.items()})
            meta["checkpoints"][str(c)] = {"covariances": m, "records": [list(k) for k in keys]}
        from safetensors.torch import save

        header = {_META_KEY: json.dumps(meta, separators=(",", ":"))}
        atomic_write(path, save(tensors, metadata=header), fsync=fsync)
        if fsync:
            fsync_dir(directory)
        self.discard()


#: The sums stored as their lower triangle (``A`` and ``G`` sums are symmetric).
_SYMMETRIC = ("|a_sum", "|g_sum")


def _pack(t: torch.Tensor) -> torch.Tensor:
    """The lower triangle ``(..., n (n + 1) / 2)`` of the symmetrised ``(..., n, n)`` sum.

    Half the bytes. The fit symmetrises ``A`` and ``G`` before its eigendecomposition, so
    keeping ``(M + Mᵀ) / 2`` loses nothing it reads.
    """
    n = t.shape[-1]
    i, j = torch.tril_indices(n, n, device=t.device)
    return (0.5 * (t + t.mT))[..., i, j]


def _unpack(v: torch.Tensor, path: Path, key: str) -> torch.Tensor:
    """The symmetric ``(..., n, n)`` matrix of a :func:`_pack` ed triangle."""
    size = v.shape[-1] if v.dim() else -1
    n = int(round(((8 * size + 1) ** 0.5 - 1) / 2)) if size >= 0 else -1
    if n < 0 or n * (n + 1) // 2 != size:
        raise StoreFormatError(
            f"{path}: tensor {key!r} of shape {tuple(v.shape)} is not a packed triangle."
        )
    i, j = torch.tril_indices(n, n)
    out = v.new_zeros(*v.shape[:-1], n, n)
    out[..., i, j] = v
    out[..., j, i] = v
    return out


def _key(entry: Mapping) -> RecordKey:
    return (int(entry["step"]), int(entry["checkpoint"]), int(entry["crc32"]), int(entry["bytes"]))


def _read_file(path: Path) -> dict[int, tuple[KroneckerCovariances, list[RecordKey]]]:
    """``{checkpoint: (sums, covered record keys)}`` of one partition's file, checked."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_META_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise StoreFormatError(f"{path} is unreadable or corrupted: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != STATISTICS_FORMAT:
        raise StoreFormatError(f"{path}: format is not {STATISTICS_FORMAT!r}.")
    if meta.get("version") != STATISTICS_VERSION:
        raise StoreFormatError(
            f"{path}: version {meta.get('version')!r}; this dattri_llm reads version "
            f"{STATISTICS_VERSION}. Upgrade dattri_llm to read it."
        )
    out = {}
    try:
        for c, block in meta["checkpoints"].items():
            prefix = f"{c}/"
            mine = {
                k[len(prefix) :]: _unpack(v, path, k) if k.endswith(_SYMMETRIC) else v
                for k, v in tensors.items()
                if k.startswith(prefix)
            }
            cov = KroneckerCovariances.from_bundle(mine, block["covariances"], path)
            out[int(c)] = (cov, [tuple(int(v) for v in k) for k in block["records"]])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreFormatError(f"{path} is corrupted: {e}") from None
    return out


def read_statistics(
    partitions: Sequence[tuple[Path, Sequence[tuple[int, Mapping]]]],
    layers: Sequence[str] | None = None,
    checkpoints: set[int] | None = None,
) -> StoreStatistics:
    """Merge the statistics of a store's partitions and find the records they cover.

    Args:
        partitions: Per partition, its directory and its records as ``(position in store
            order, index entry)``.
        layers: Keep only these layers (``None``: all).
        checkpoints: Only these checkpoint labels (``None``: all).

    Returns:
        The merged sums and the covered records. A partition's sums for a checkpoint are left
        out, with a warning, when a record they cover is no longer in the partition (a
        quarantined or deleted shard): those records are then read from the shards.

    Raises:
        StoreFormatError: an unreadable file, or sums whose sample count differs from the
            records they cover.
    """
    merged: dict[int, KroneckerCovariances] = {}
    covered: dict[int, set[int]] = {}
    mixed: set[int] = set()  # labels whose partitions hold other layers under one name
    for directory, records in partitions:
        path = directory / KRONECKER_FILE
        if not path.exists():
            continue
        where: dict[RecordKey, list[tuple[int, int]]] = {}
        for pos, entry in records:
            where.setdefault(_key(entry), []).append((pos, int(entry["n"])))
        for c, (cov, keys) in sorted(_read_file(path).items()):
            if checkpoints is not None and c not in checkpoints:
                continue
            found, rows = _locate(keys, where)
            if found is None:
                warnings.warn(
                    f"{path}: the Kronecker statistics of checkpoint {c} cover records this "
                    "partition no longer holds (a shard was quarantined or deleted); they are "
                    "not used, and a K-FAC fit reads those records' factors instead.",
                    UserWarning,
                    stacklevel=3,
                )
                continue
            _check_counts(cov, rows, path, c)
            if layers is not None:
                cov.layers = {n: v for n, v in cov.layers.items() if n in layers}
                cov.skipped = {n: v for n, v in cov.skipped.items() if n in layers}
            if c in mixed:
                continue
            try:
                merged.setdefault(c, KroneckerCovariances(tokens=STATISTICS_TOKENS)).merge(cov)
            except ValueError:
                # a store mixing captures: the compatibility check names it when the records
                # are read, so these sums are dropped rather than refused here
                mixed.add(c)
                merged.pop(c, None)
                covered.pop(c, None)
                continue
            covered.setdefault(c, set()).update(found)
    for cov in merged.values():
        cov.reduced = True
    return StoreStatistics(merged, frozenset().union(*covered.values()))


def _locate(
    keys: list[RecordKey], where: dict[RecordKey, list[tuple[int, int]]]
) -> tuple[list[int] | None, int]:
    """The store positions of the covered records and their rows (``None``: one is gone)."""
    used: dict[RecordKey, int] = {}
    found, rows = [], 0
    for key in keys:
        i = used.get(key, 0)
        hits = where.get(key, [])
        if i >= len(hits):
            return None, 0
        used[key] = i + 1
        found.append(hits[i][0])
        rows += hits[i][1]
    return found, rows


def _check_counts(cov: KroneckerCovariances, rows: int, path: Path, c: int) -> None:
    for name, layer in cov.layers.items():
        if layer.num_samples != rows:
            raise StoreFormatError(
                f"{path}: the Kronecker statistics of layer {name!r} at checkpoint {c} count "
                f"{layer.num_samples:g} samples, but the records they cover hold {rows}; the "
                "file does not belong to these records. Delete it to read the factors instead."
            )
