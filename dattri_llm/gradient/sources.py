"""``GradientSource``: what attributors read — blocks of ``(step, Gradient, hashes)``.

A source is an iterable of :class:`GradientBlock` in a stable order, plus ``rereadable``
(whether it can be iterated again, e.g. a store on disk, as opposed to a live stream that
recomputes). Attributors never care where blocks come from.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from dattri_llm.gradient.gradient import GradientBlock, GradientRecord

if TYPE_CHECKING:
    from dattri_llm.gradient.compat import CaptureFacts
    from dattri_llm.gradient.store import GradientStorageManager

__all__ = ["GradientBlock", "GradientSource", "InMemoryGradientSource", "DiskGradientSource"]


@runtime_checkable
class GradientSource(Protocol):
    """The contract every gradient source satisfies."""

    #: Whether iterating again yields the same blocks without recomputation.
    rereadable: bool

    def __iter__(self) -> Iterator[GradientBlock]:
        """Yield blocks in a stable order."""
        ...


class InMemoryGradientSource:
    """A source over records already in memory (e.g. from a ``CaptureCallback``)."""

    rereadable = True

    def __init__(self, records: Iterable[GradientRecord | GradientBlock]) -> None:
        self._blocks: list[GradientBlock] = []
        for r in records:
            if isinstance(r, GradientRecord):
                self._blocks.append(
                    GradientBlock(r.step, r.gradient, list(r.hashes), r.checkpoint, r.metadata)
                )
            else:
                self._blocks.append(r)

    def __iter__(self) -> Iterator[GradientBlock]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)


class DiskGradientSource:
    """A source over a gradient store on disk: one block per stored record, in store order.

    Store order is by rank, then step, then write order (see ``docs/STORE_FORMAT.md``).

    Args:
        store_or_path: A :class:`~dattri_llm.GradientStorageManager` or its directory.
        layers: Read only these layers (default: every stored layer).
        device: Where blocks are loaded.
        dtype: Cast floating tensors (integer index factors keep their dtype).
        checkpoints: Only records with these checkpoint labels (e.g. the last checkpoint of a
            store captured at several, for a single-checkpoint method); default: all.

    Raises:
        FileNotFoundError: the directory does not exist.
        StoreFormatError: the directory is not a gradient store (or holds no records).
        KeyError: ``layers`` names a layer, or ``checkpoints`` a label, the store does not
            hold.
    """

    rereadable = True

    def __init__(
        self,
        store_or_path: GradientStorageManager | str | os.PathLike,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        checkpoints: Sequence[int] | None = None,
    ) -> None:
        from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError
        from dattri_llm.gradient.store.format import META_FILE

        if isinstance(store_or_path, GradientStorageManager):
            store = store_or_path
        else:
            path = Path(store_or_path)
            if not path.exists():
                raise FileNotFoundError(
                    f"gradient store directory {path} does not exist; pass the save_dir an "
                    "OffloadCallback / GradientStorageManager wrote."
                )
            if not path.is_dir():
                raise NotADirectoryError(f"{path} is a file, not a gradient store directory.")
            store = GradientStorageManager(path)
            if not (path / META_FILE).is_file() and not store.ranks:
                raise StoreFormatError(
                    f"{path} is not a gradient store (no {META_FILE}); pass the save_dir of a "
                    "GradientStorageManager."
                )
        if len(store) == 0:
            raise StoreFormatError(f"the gradient store {store.save_dir} holds no records.")
        self.store = store
        self.layers = store.check_layers(layers)
        self.checkpoints = store.check_checkpoints(checkpoints)
        self.device = device
        self.dtype = dtype

    def __iter__(self) -> Iterator[GradientBlock]:
        return self.store.iter_blocks(self.layers, self.device, self.dtype, self.checkpoints)

    def __len__(self) -> int:
        if self.checkpoints is None:
            return len(self.store)
        return sum(r.checkpoint in self.checkpoints for r in self.store.records())

    def capture_facts(self) -> CaptureFacts:
        """What the store's gradients (of the selected layers) were captured as.

        See :meth:`~dattri_llm.GradientStorageManager.capture_facts`.
        """
        return self.store.capture_facts(self.layers)

    @property
    def layer_names(self) -> list[str]:
        """Names of the layers the blocks hold."""
        return list(self.layers) if self.layers is not None else self.store.layer_names

    @property
    def num_samples(self) -> int:
        """Total rows over all blocks."""
        if self.checkpoints is None:
            return self.store.num_samples
        return sum(len(r.hashes) for r in self.store.records() if r.checkpoint in self.checkpoints)
