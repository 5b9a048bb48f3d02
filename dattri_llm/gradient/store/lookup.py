"""Finding samples in a gradient store by identity: locations, lookups, one sample's rows.

:class:`SampleLookup` is mixed into :class:`~dattri_llm.GradientStorageManager`; it reads the
manager's ordered index (``_ordered()``, its ``_sources`` / ``_extra`` / ``_order``), its record
loader (``_load``), and finds a sample with a
:class:`~dattri_llm.gradient.store.sample_locator.SampleLocator` (a sorted numpy array over
the memory-mapped ``samples.bin`` files, no Python object per sample).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dattri_llm.gradient.gradient import Gradient, GradientBlock
from dattri_llm.gradient.store.sample_locator import SampleLocator
from dattri_llm.utils.hashing import hash_sample

__all__ = ["SampleLocation", "SampleLookup"]


class SampleLocation(NamedTuple):
    """One occurrence of a sample: record ``record`` (store order), row ``row``."""

    record: int
    rank: int
    step: int
    checkpoint: int
    row: int
    path: Path


class SampleLookup:
    """Lookup by sample identity (see the module docstring for what it reads)."""

    def _hash_map(self) -> dict[str, list[tuple[int, int]]]:
        raise NotImplementedError

    def _ordered(self) -> list:
        raise NotImplementedError

    def _locator(self) -> SampleLocator:
        """The sample locator of the current store order (built on first use)."""
        ordered = self._ordered()
        with self._lock:
            built = getattr(self, "_located", None)
            if built is None or built[0] is not self._order:
                locator = SampleLocator(
                    self._sources, self._extra, self._order, lambda p: ordered[p][1]["hashes"]
                )
                self._located = built = (self._order, locator)
            return built[1]

    def _key(
        self, key: str | Mapping[str, Any] | torch.Tensor, hash_keys: Sequence[str] | None = None
    ) -> str:
        return key if isinstance(key, str) else hash_sample(key, keys=hash_keys)

    def locations(self, sample_hash: str) -> list[SampleLocation]:
        """Every (record, step, row) at which a sample occurs, in store order.

        The first lookup builds the store's sample locator (a sorted numpy array over the
        partitions' ``samples.bin``, 20 bytes per sample row); each is then a binary search.
        """
        ordered = self._ordered()
        out = []
        for pos, row in self._locator().find(sample_hash):
            part, e = ordered[pos]
            out.append(
                SampleLocation(
                    pos, part.rank, e["step"], e["checkpoint"], row, part.directory / e["shard"]
                )
            )
        return out

    def lookup(
        self, inputs: Mapping[str, Any] | torch.Tensor | str, hash_keys: Sequence[str] | None = None
    ) -> list[SampleLocation]:
        """Locations of one sample given by its fields (hashed with ``hash_sample``) or hash.

        Args:
            inputs: One sample (a dict of tensors without batch axis) or its hash.
            hash_keys: Fields to hash, as in capture (default: ``input_ids`` when present).
        """
        return self.locations(self._key(inputs, hash_keys))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        return bool(self._locator().find(key))

    def load_sample_steps(
        self,
        sample: str | Mapping[str, Any] | torch.Tensor,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        hash_keys: Sequence[str] | None = None,
    ) -> list[GradientBlock]:
        """Every occurrence of one sample as one-row blocks, in store order.

        Raises:
            KeyError: the sample is not in the store.
        """
        h = self._key(sample, hash_keys)
        locs = self.locations(h)
        if not locs:
            raise KeyError(f"sample {h[:16]}... is not in the store {self.save_dir}.")
        layers = self.check_layers(layers)
        ordered = self._ordered()
        out = []
        for loc in locs:
            part, e = ordered[loc.record]
            grad = self._load(part, e, layers, device, dtype, slice(loc.row, loc.row + 1))
            out.append(GradientBlock(e["step"], grad, [h], e["checkpoint"]))
        return out

    def load_sample(
        self,
        sample: str | Mapping[str, Any] | torch.Tensor,
        step: int | None = None,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        hash_keys: Sequence[str] | None = None,
    ) -> Gradient:
        """One sample's gradient (one row): its first occurrence, or the one at ``step``.

        Raises:
            KeyError: the sample is not in the store, or not at ``step``.
        """
        h = self._key(sample, hash_keys)
        locs = self.locations(h)
        if step is not None:
            at = [loc for loc in locs if loc.step == step]
            if not at:
                raise KeyError(
                    f"sample {h[:16]}... is not stored at step {step}; it is at steps "
                    f"{sorted({loc.step for loc in locs})}."
                )
            locs = at
        if not locs:
            raise KeyError(f"sample {h[:16]}... is not in the store {self.save_dir}.")
        part, e = self._ordered()[locs[0].record]
        row = locs[0].row
        return self._load(part, e, self.check_layers(layers), device, dtype, slice(row, row + 1))
