"""``GradientSource``: what attributors read — blocks of ``(step, Gradient, hashes)``.

A source is an iterable of blocks in a stable order, plus ``rereadable`` (whether it can be
iterated again, e.g. a store on disk, as opposed to a live stream that recomputes).
Attributors never care where blocks come from.

A block is a ``(step, gradient, hashes)`` tuple (the specification's contract) or a richer
``(step, gradient, hashes, checkpoint, metadata)`` one; the library's own sources yield
:class:`GradientBlock`, which unpacks as the specification's triple and carries ``checkpoint``
and ``metadata`` as attributes. :func:`as_source` is the one place a source that did not come
from the library is read through: every item becomes a :class:`GradientBlock`, the missing
fields taking their defaults (``checkpoint=0``, ``metadata={}``), and anything else is refused
with the item's position and type.

A source over a gradient store also says so: its ``store_reading()`` returns a
:class:`StoreReading` (which store, which of its records, read how), and :func:`store_reading`
asks any source for it (``None``: not a store). The score engine plans from that (rows known
before any tensor is read, ranks, resuming, the vector fast path) through the store's public
:class:`RecordStore` methods only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from dattri_llm.gradient.gradient import NO_METADATA, Gradient, GradientBlock, GradientRecord

if TYPE_CHECKING:
    from dattri_llm.gradient.compat import CaptureFacts
    from dattri_llm.gradient.store import GradientStorageManager, RecordInfo

__all__ = [
    "GradientBlock",
    "GradientSource",
    "InMemoryGradientSource",
    "DiskGradientSource",
    "BlockSource",
    "RecordStore",
    "StoreReading",
    "as_block",
    "as_source",
    "store_reading",
]


@runtime_checkable
class GradientSource(Protocol):
    """The contract every gradient source satisfies.

    ``__iter__`` yields ``(step, gradient, hashes)`` tuples — or ``(step, gradient, hashes,
    checkpoint)``, ``(step, gradient, hashes, checkpoint, metadata)``, a
    :class:`GradientBlock` or a :class:`GradientRecord` — in a stable order: ``step`` an int,
    ``gradient`` a :class:`~dattri_llm.Gradient` of ``B`` rows, ``hashes`` ``B`` sample ids.
    A source without ``rereadable`` is read once when it is not a list or tuple.
    """

    #: Whether iterating again yields the same blocks without recomputation.
    rereadable: bool

    def __iter__(self) -> Iterator[GradientBlock]:
        """Yield blocks in a stable order."""
        ...


class RecordStore(Protocol):
    """What a reader of a gradient store uses of it (``GradientStorageManager`` implements it).

    Records are addressed by their position in *store order* (by rank, then step, then write
    order); everything but :meth:`load_record` is read from the index, without a tensor.
    """

    #: The store directory.
    save_dir: Path

    def records(self) -> list[RecordInfo]:
        """Every record's location and identity (rank, seq, step, checkpoint, hashes, path)."""
        ...

    def record_sizes(self) -> list[int]:
        """The shard bytes of every record."""
        ...

    def fingerprint(self) -> dict[str, Any]:
        """A JSON digest of the store's content that changes whenever a record does."""
        ...

    def load_record(
        self,
        index: int,
        layers: Sequence[str] | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> GradientRecord:
        """Record ``index`` with its tensors."""
        ...

    def capture_facts(self, layers: Sequence[str] | None = None) -> CaptureFacts:
        """What the store's gradients were captured as."""
        ...

    @property
    def layer_names(self) -> list[str]:
        """The stored layers, in capture order."""
        ...


class StoreReading(NamedTuple):
    """How a source reads a store: which store, which of its records, where and how.

    The source yields one block per record of the store, in store order, except the records
    whose checkpoint label ``checkpoints`` leaves out.

    Attributes:
        store: The store.
        layers: Only these layers (``None``: all).
        device: Where tensors are loaded; dtype: cast floating tensors (``None``: as stored).
        checkpoints: Only records with these checkpoint labels (``None``: all).
    """

    store: RecordStore
    layers: list[str] | None
    device: str | torch.device
    dtype: torch.dtype | None
    checkpoints: set[int] | None

    def wants(self, checkpoint: int) -> bool:
        """Whether the source yields the records of ``checkpoint``."""
        return self.checkpoints is None or checkpoint in self.checkpoints


def store_reading(source: object) -> StoreReading | None:
    """``source.store_reading()`` for a source over a store, ``None`` for any other source."""
    method = getattr(source, "store_reading", None)
    return method() if callable(method) else None


def as_block(item: object, where: str = "a gradient source") -> GradientBlock:
    """One item of a source as a :class:`GradientBlock` (see the module docstring).

    Args:
        item: A :class:`GradientBlock`, a :class:`GradientRecord`, or a tuple ``(step,
            gradient, hashes[, checkpoint[, metadata]])``.
        where: How the error names the item (e.g. ``"item 3 of the train source"``).

    Raises:
        TypeError: the item is none of those, or a field has the wrong type.
    """
    if isinstance(item, GradientBlock):
        return item
    if isinstance(item, GradientRecord):
        return GradientBlock(
            item.step, item.gradient, list(item.hashes), item.checkpoint, item.metadata
        )
    fix = (
        "a GradientSource yields (step, Gradient, hashes) tuples (optionally followed by "
        "checkpoint and metadata) or GradientBlocks."
    )
    if not isinstance(item, tuple) or not 3 <= len(item) <= 5:
        size = f" of {len(item)} fields" if isinstance(item, tuple) else ""
        raise TypeError(f"{where} is a {type(item).__name__}{size}; {fix}")
    step, gradient, hashes, *rest = item
    if not isinstance(gradient, Gradient):
        raise TypeError(
            f"{where}: its second field must be a dattri_llm Gradient, got "
            f"{type(gradient).__name__}; {fix}"
        )
    if isinstance(hashes, torch.Tensor):
        hashes = hashes.tolist()
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Iterable):
        raise TypeError(
            f"{where}: its third field (hashes) must be a sequence of one sample id per "
            f"gradient row, got {type(hashes).__name__}."
        )
    if isinstance(step, bool) or not isinstance(step, (int, torch.Tensor)):
        raise TypeError(f"{where}: its first field (step) must be an int, got {step!r}.")
    checkpoint = rest[0] if rest else 0
    metadata = rest[1] if len(rest) > 1 else None
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(
            f"{where}: its fifth field (metadata) must be a mapping, got {type(metadata).__name__}."
        )
    return GradientBlock(
        int(step),
        gradient,
        [h if isinstance(h, str) else str(h) for h in hashes],
        int(checkpoint),
        NO_METADATA if metadata is None else metadata,
    )


def _forwarded(name: str, doc: str) -> property:
    """A :class:`BlockSource` attribute that is the wrapped source's (absent when it lacks it)."""

    def get(self: BlockSource) -> Any:
        return getattr(self.source, name)  # an AttributeError keeps ``hasattr`` honest

    return property(get, doc=doc)


class BlockSource:
    """A user source read through :func:`as_block` (what :func:`as_source` returns).

    The optional capabilities the library asks a source for are the wrapped source's, when it
    has them: ``capture_facts``, ``num_samples``, ``layer_names``, ``steps`` and ``load_step``
    (random access by step, its blocks read through :func:`as_block` too).
    """

    capture_facts = _forwarded("capture_facts", "The wrapped source's ``capture_facts``.")
    num_samples = _forwarded("num_samples", "The wrapped source's ``num_samples``.")
    layer_names = _forwarded("layer_names", "The wrapped source's ``layer_names``.")
    steps = _forwarded("steps", "The wrapped source's ``steps``.")

    yields_blocks = True

    def __init__(self, source: Iterable[object], side: str) -> None:
        self.source = source
        self.side = side
        self.rereadable = bool(getattr(source, "rereadable", isinstance(source, (list, tuple))))

    def __iter__(self) -> Iterator[GradientBlock]:
        for i, item in enumerate(self.source):
            yield as_block(item, f"item {i} of the {self.side} source")

    @property
    def load_step(self) -> Any:
        """The wrapped source's ``load_step(step)``, its blocks read through :func:`as_block`."""
        load = self.source.load_step  # absent: an AttributeError, as ``hasattr`` expects
        return lambda step: [
            as_block(b, f"a block of step {step} of the {self.side} source") for b in load(step)
        ]


def as_source(source: Any, side: str = "train") -> Any:
    """``source`` as a source of :class:`GradientBlock` — the one entry of user sources.

    The library's own sources (they set ``yields_blocks = True``) are returned as they are;
    any other iterable (a user's class, a generator, a list of tuples) is read through
    :func:`as_block`, so ``(step, Gradient, hashes)`` tuples work wherever a source does.

    Args:
        source: A gradient source or an iterable of blocks.
        side: ``"train"`` or ``"test"`` (how errors name it).

    Raises:
        TypeError: ``source`` is not iterable.
    """
    if getattr(source, "yields_blocks", False):
        return source
    if not isinstance(source, Iterable):
        raise TypeError(
            f"the {side} source must be an iterable of (step, Gradient, hashes) blocks (a "
            f"GradientSource), got {type(source).__name__}."
        )
    return BlockSource(source, side)


class InMemoryGradientSource:
    """A source over records already in memory (e.g. from a ``CaptureCallback``).

    Args:
        records: :class:`GradientRecord`, :class:`GradientBlock` or ``(step, Gradient,
            hashes[, checkpoint[, metadata]])`` tuples (see :func:`as_block`).
    """

    rereadable = True
    yields_blocks = True

    def __init__(self, records: Iterable[GradientRecord | GradientBlock | tuple]) -> None:
        self._blocks: list[GradientBlock] = [
            as_block(r, f"item {i} of the records") for i, r in enumerate(records)
        ]

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

    Example:
        >>> import tempfile, torch
        >>> from dattri_llm import (DiskGradientSource, GradientStorageManager, HookManager,
        ...                         OffloadCallback)
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> store = GradientStorageManager(tempfile.mkdtemp())
        >>> hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)])
        >>> with hm.collect(deregister_on_exit=True):
        ...     for step in range(2):
        ...         model(torch.randn(4, 3)).pow(2).sum().backward()
        >>> store.close()
        >>> for block in DiskGradientSource(store.save_dir):  # one block per stored record
        ...     print(block.step, len(block.hashes), block.gradient.layer_names)
        0 4 ['0']
        1 4 ['0']
    """

    rereadable = True
    yields_blocks = True

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

    def store_reading(self) -> StoreReading:
        """The store this source reads, and how (see :class:`StoreReading`)."""
        return StoreReading(self.store, self.layers, self.device, self.dtype, self.checkpoints)

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
