"""``GradientStreamer``: per-sample gradients computed live, as a :class:`GradientSource`.

One forward and one backward per batch under a :class:`HookManager`. The model is used as a
*frozen probe*: during each batch it is in eval mode and under
:meth:`HookManager.fixed_weights_mode`, so the backward computes only the hooked layers'
output gradients and no weight gradient (the first batch is an ordinary backward, for the
coverage check). Training mode, ``requires_grad`` flags and ``.grad`` are restored after every batch
(the model is never left altered while the stream is suspended). A DDP / FSDP wrapper cannot
be frozen (its reducer expects gradients): there the backward is a normal one and every
parameter's ``.grad`` is saved before and restored after.

Samples are identified by :func:`~dattri_llm.utils.hashing.hash_sample` of the dataset items
(tuple items become fields ``"0"``, ``"1"``, ...), the same identity a store gives to a batch
that stacks them. Only torch is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, default_collate

from dattri_llm.gradient.callbacks.capture import CaptureCallback
from dattri_llm.gradient.hooks import HookManager, HookManagerConfig
from dattri_llm.gradient.sources import GradientBlock
from dattri_llm.utils.hashing import hash_sample
from dattri_llm.utils.progress import progress_bar

__all__ = [
    "GradientStreamer",
    "sample_id",
    "pad_collate",
    "move_to_device",
    "is_distributed_wrapper",
]


def _as_fields(item: Any) -> Mapping[str, Any] | torch.Tensor:
    if isinstance(item, (tuple, list)):
        return {str(i): v for i, v in enumerate(item)}
    return item


def sample_id(item: Any, config: HookManagerConfig | None = None) -> str:
    """Identity of one dataset item, as the hook manager would give its row in a batch.

    Uses ``config.sample_id_key`` (the field's scalar value) when set, else the content hash
    over ``config.hash_keys`` (default ``input_ids``, or every tensor field).
    """
    fields = _as_fields(item)
    key = config.sample_id_key if config is not None else None
    if key is not None:
        if not isinstance(fields, Mapping) or key not in fields:
            raise KeyError(f"sample_id_key {key!r} is not a field of the dataset items.")
        value = torch.as_tensor(fields[key])
        if value.numel() != 1:
            raise ValueError(
                f"sample_id_key {key!r}: the field {key!r} of a dataset item has shape "
                f"{tuple(value.shape)}; it must be one scalar id per sample. Store each item's "
                "id as a scalar, or drop sample_id_key to identify samples by content hash."
            )
        return str(value.reshape(()).item())
    keys = config.hash_keys if config is not None else None
    if keys is not None and isinstance(fields, Mapping):
        keys = [k for k in keys if k in fields] or None
    return hash_sample(fields, keys=keys)


def pad_collate(pad_value: int = 0) -> Callable[[list[Any]], Any]:
    """A collate that right-pads the first axis of each tensor field to the batch maximum.

    ``labels`` are padded with ``-100`` and ``attention_mask`` with ``0``; other fields with
    ``pad_value``. 0-d tensors and non-tensors are collated as by ``default_collate``.
    """

    def pad(values: list[Any], name: str) -> Any:
        if not all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
            return default_collate(values)
        length = max(v.shape[0] for v in values)
        fill = -100 if name == "labels" else 0 if name == "attention_mask" else pad_value
        out = values[0].new_full((len(values), length, *values[0].shape[1:]), fill)
        for i, v in enumerate(values):
            out[i, : v.shape[0]] = v
        return out

    def collate(items: list[Any]) -> Any:
        first = items[0]
        if isinstance(first, Mapping):
            return {k: pad([it[k] for it in items], k) for k in first}
        if isinstance(first, (tuple, list)):
            return [pad([it[i] for it in items], str(i)) for i in range(len(first))]
        return pad(items, "input_ids")

    collate.expects_tensors = True  # type: ignore[attr-defined]
    return collate


_PAD_HINT = (
    "Pad them: AttributionArguments(dataloader_collate='pad') for the attributors, "
    "GradientStreamer(collate_fn=pad_collate()) for a streamer, or pass a collate_fn."
)
_TORCH_FORMAT_HINT = (
    "A Hugging Face datasets.Dataset returns Python lists unless it is formatted for torch: "
    "use dataset.with_format('torch') (or dataset.set_format('torch')), or pass a collate_fn "
    "that builds tensors."
)


def _check_tensor_items(items: list[Any]) -> None:
    """Refuse dataset items whose fields are Python lists (the default collates need tensors)."""
    first = items[0]
    if isinstance(first, Mapping):
        fields = list(first.items())
    elif isinstance(first, (tuple, list)):
        fields = list(enumerate(first))
    else:
        return
    for key, value in fields:
        if isinstance(value, (list, tuple)):
            raise TypeError(
                f"dataset items hold Python lists, not tensors (field {key!r}), which the "
                f"default collate cannot batch as samples. {_TORCH_FORMAT_HINT}"
            )


def move_to_device(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor of a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def is_distributed_wrapper(model: nn.Module) -> bool:
    """Whether ``model`` is a DDP or FSDP wrapper (whose backward must stay a normal one)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return True
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    try:
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for m in model.modules())
    except ImportError:  # pragma: no cover
        return False


class _WithIds:
    """Collate wrapper that also returns the items' identities (computed in the workers)."""

    def __init__(self, collate: Callable[[list[Any]], Any], config: HookManagerConfig) -> None:
        self.collate = collate
        self.config = config

    def __call__(self, items: list[Any]) -> tuple[Any, list[str]]:
        if self.collate is default_collate or getattr(self.collate, "expects_tensors", False):
            _check_tensor_items(items)
        try:
            batch = self.collate(items)
        except RuntimeError as err:
            if "equal size" not in str(err) and "same size" not in str(err):
                raise
            raise ValueError(
                f"could not batch the samples: their tensors have different lengths ({err}). "
                f"{_PAD_HINT}"
            ) from err
        return batch, [sample_id(it, self.config) for it in items]


class GradientStreamer:
    """Live per-sample gradients of a dataset, one :class:`GradientBlock` per batch.

    Args:
        model: The model (or its DDP / FSDP wrapper), at the state to probe.
        dataset: A sequence or ``torch.utils.data.Dataset`` of samples (dicts of tensors or
            tuples / lists of tensors).
        loss_func: ``loss_func(model, batch) -> scalar``, the sum of the batch's per-sample
            losses.
        hook_config: Which layers to capture (default: every supported trainable layer).
        batch_size: Samples per forward/backward.
        checkpoint: Label of the model state, stored in every block.
        step: Step stored in every block (default: ``checkpoint``).
        collate_fn: Builds a batch from a list of items (default ``default_collate``).
        num_workers: ``DataLoader`` workers.
        drop_last: Drop the last incomplete batch.
        device: Where batches are moved (default: the device of the model's parameters).
        frozen: Use the frozen probe (default). Ignored for DDP / FSDP wrappers.
        show_progress: Show a tqdm bar (``None``: only when standard error is a terminal).
        desc: Label of the bar.
        optimizer: Preconditioned capture (LESS): each gradient mapped through this
            optimizer's update (see ``HookManager(optimizer=...)``); default raw gradients.
        precondition_scale: ``HookManager(precondition_scale=...)`` of that map.
        precondition: ``HookManager(precondition=...)``: ``"second_moment"`` corrects each
            gradient by TrackStar's ``1/√(v + ε)`` instead (e.g. queries for a train store
            captured so).
        hook_manager: A :class:`HookManager` on ``model`` holding a :class:`CaptureCallback`,
            reused by every pass instead of one built per pass (its hooks stay registered: the
            caller removes them). Building one resolves the layers and the projection, a cost
            that dominates a stream of one small batch, e.g. a live query. ``hook_config``,
            ``optimizer`` and the precondition options are then the manager's own.

    ``rereadable`` is ``False``: iterating again recomputes every block.
    """

    rereadable = False
    yields_blocks = True

    def __init__(
        self,
        model: nn.Module,
        dataset: Sequence[Any] | torch.utils.data.Dataset,
        loss_func: Callable[[nn.Module, Any], torch.Tensor],
        hook_config: HookManagerConfig | None = None,
        batch_size: int = 8,
        checkpoint: int = 0,
        step: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        drop_last: bool = False,
        device: torch.device | str | None = None,
        frozen: bool = True,
        show_progress: bool | None = False,
        desc: str = "gradients",
        optimizer: Any = None,
        precondition_scale: float | str = 1.0,
        precondition: bool | str = True,
        hook_manager: HookManager | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"GradientStreamer: model must be an nn.Module, got {type(model).__name__}."
            )
        if not callable(loss_func):
            raise TypeError("GradientStreamer: loss_func must be callable (model, batch) -> loss.")
        if not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__iter__"):
            raise TypeError(
                f"GradientStreamer: dataset must be a sequence or a torch Dataset, "
                f"got {type(dataset).__name__}."
            )
        if batch_size < 1:
            raise ValueError(f"GradientStreamer: batch_size must be >= 1, got {batch_size}.")
        fmt = getattr(dataset, "format", None)
        if (
            collate_fn is None
            and type(dataset).__module__.startswith("datasets.")
            and isinstance(fmt, Mapping)
            and fmt.get("type") not in ("torch", "pt")
        ):
            raise TypeError(
                f"GradientStreamer: the dataset is a Hugging Face datasets.Dataset formatted "
                f"as {fmt.get('type')!r}, not 'torch'. {_TORCH_FORMAT_HINT}"
            )
        self.model = model
        self.dataset = dataset
        self.loss_func = loss_func
        self.hook_config = hook_config or HookManagerConfig()
        self.batch_size = batch_size
        self.checkpoint = checkpoint
        self.step = checkpoint if step is None else step
        self.collate_fn = collate_fn or default_collate
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.device = device
        self.frozen = frozen and not is_distributed_wrapper(model)
        self.show_progress = show_progress
        self.desc = desc
        self.optimizer = optimizer
        self.precondition_scale = precondition_scale
        self.precondition = precondition
        self.hook_manager = hook_manager
        if hook_manager is not None:
            if hook_manager.model is not model:
                raise ValueError(
                    "GradientStreamer: hook_manager is registered on another model than the "
                    "streamer's; build it with HookManager(model, ...)."
                )
            if _capture_callback(hook_manager) is None:
                raise ValueError(
                    "GradientStreamer: hook_manager has no CaptureCallback, so its captured "
                    "gradients would not reach the stream; build it with "
                    "HookManager(model, config, callbacks=[CaptureCallback()])."
                )
            self.hook_config = hook_manager.config

    def __len__(self) -> int:
        n = len(self.dataset)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _loader(self) -> DataLoader:
        return DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            drop_last=self.drop_last,
            collate_fn=_WithIds(self.collate_fn, self.hook_config),
        )

    def _device(self) -> torch.device | str:
        if self.device is not None:
            return self.device
        p = next(self.model.parameters(), None)
        return p.device if p is not None else "cpu"

    @contextlib.contextmanager
    def _probe(self, hm: HookManager) -> Iterator[None]:
        """Put the model in probe state for one batch and restore it afterwards."""
        modes = [(m, m.training) for m in self.model.modules()]
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        try:
            self.model.eval()
            if self.frozen:  # per batch: the model may train between two batches
                with hm.fixed_weights_mode():
                    yield
            else:
                for p in params:
                    p.grad = None
                yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            for m, t in modes:
                m.training = t

    def __iter__(self) -> Iterator[GradientBlock]:
        device = self._device()
        owned = self.hook_manager is None
        if owned:
            cb = CaptureCallback()
            hm = HookManager(
                self.model,
                config=self.hook_config,
                callbacks=[cb],
                optimizer=self.optimizer,
                precondition_scale=self.precondition_scale,
                precondition=self.precondition,
            )
        else:
            hm = self.hook_manager
            cb = _capture_callback(hm)
            cb.record = None  # a record left by an interrupted earlier pass is not this batch's
        hm.checkpoint = self.checkpoint
        loader = self._loader()
        n = len(self.dataset) if hasattr(self.dataset, "__len__") else None
        if n is not None and self.drop_last:
            n -= n % self.batch_size
        bar = progress_bar(
            self.show_progress, total=n, desc=self.desc, unit="sample", unit_scale=True
        )
        try:
            for batch, ids in loader:
                batch = move_to_device(batch, device)
                with self._probe(hm), torch.enable_grad(), hm.collect():
                    hm.set_sample_ids(ids)
                    loss = self.loss_func(self.model, batch)
                    _check_loss(loss)
                    loss.backward()
                if cb.record is None:
                    raise RuntimeError(
                        "the backward reached none of the hooked layers: check that loss_func "
                        "calls the model it is given and that hook_config selects layers on the "
                        "path of the loss."
                    )
                # built in a call so that no local of this frame keeps the block's gradient
                # alive while the consumer holds it (a score loop frees joined blocks)
                yield self._block(cb.pop(), bar)
        finally:
            if owned:
                hm.remove()
            if bar is not None:
                bar.close()

    def _block(self, rec: Any, bar: Any) -> GradientBlock:
        if bar is not None:
            bar.update(len(rec.hashes))  # samples: the rate and ETA in samples
        return GradientBlock(
            self.step, rec.gradient, list(rec.hashes), self.checkpoint, rec.metadata
        )


def _capture_callback(hm: HookManager) -> CaptureCallback | None:
    return next((cb for cb in hm.callbacks if isinstance(cb, CaptureCallback)), None)


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_func must return a tensor, got {type(loss).__name__}.")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_func must return a scalar (the sum of the per-sample losses), "
            f"got shape {tuple(loss.shape)}."
        )
    if not loss.requires_grad:
        raise RuntimeError(
            "the loss does not depend on any hooked layer (it does not require grad): check "
            "that loss_func calls the model it is given and that hook_config selects layers on "
            "the path of the loss."
        )
