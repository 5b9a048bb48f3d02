"""``OffloadCallback``: persist captured gradients to a gradient store during training."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.store.compact import (
    cast_gradient,
    check_keep_token_factors,
    check_storage_dtype,
    compact_gradient,
    storage_settings,
)
from dattri_llm.gradient.store.kronecker_stats import statistics_view
from dattri_llm.utils.names import check_names

if TYPE_CHECKING:
    from dattri_llm.gradient.store import GradientStorageManager

__all__ = ["OffloadCallback", "batch_id", "LOSS_REDUCTION_KEY"]

#: The record-metadata key under which ``OffloadCallback(loss_reduction=...)`` records how the
#: training loss combined each batch (``"sum"`` or ``"mean"``); the trajectory attributors read it.
LOSS_REDUCTION_KEY = "loss_reduction"


def batch_id(hashes: list[str]) -> str:
    r"""The identity of a batch stored with ``recording_type="per_batch"``.

    ``"batch:" + sha256("\\n".join(sorted(hashes)))`` — independent of the order of the
    samples inside the batch (gradient accumulation concatenates all micro-batches' hashes).
    """
    digest = hashlib.sha256("\n".join(sorted(hashes)).encode()).hexdigest()
    return f"batch:{digest}"


class OffloadCallback(HookCallback):
    """Write each captured step to a :class:`~dattri_llm.GradientStorageManager`.

    No extra forward or backward pass: the records the :class:`~dattri_llm.HookManager`
    assembles are written as they come (on a background thread when the store writes
    asynchronously), and the store is flushed when the collection context ends.

    Steps. The hook manager counts backward passes (*micro-steps*). With
    ``gradient_accumulation_steps = n`` the stored step is ``micro_step // n``, so the ``n``
    micro-batches of one optimizer step share a step. Only steps with
    ``step % offload_interval == 0`` are written. Writing into a store that already holds
    records at the same checkpoint label (``GradientStorageManager(..., mode="append")``, e.g.
    resuming an interrupted capture) continues the steps after the last stored one, so no step
    label repeats; ``step_offset`` sets the offset yourself instead.

    Lifecycle. When the collection context ends — normally or with an exception — the pending
    records are made durable and the store's writer is released (closed; a later write reopens
    it), so an interrupted capture never leaves the store locked.

    Recording types:

    * ``"per_sample"`` — every micro-batch's per-sample gradients are written as they are
      (factors stay factors), one record per micro-batch, one hash per sample.
    * ``"per_batch"`` — the batch gradient (``Gradient.aggregate()``: the sum over samples,
      dense, summed over the accumulated micro-batches) is written as one record with one row
      identified by :func:`batch_id` of the member hashes; the member hashes are kept in the
      record's index line (``extra["members"]``). The record is written when the last
      micro-batch of the step arrives, or when the context ends.

    Compact storage (the default). Each layer of a ``"per_sample"`` record is written in the
    smaller of its two exact forms, decided per record from the actual tensors: its factors
    with their token axis, or its dense per-sample gradient (for a ``logra`` projected layer the
    ``k x d`` projected gradient). A 16x16 ``logra`` store of GPT-2 2x128 at 256 tokens is
    8.6 KB per sample instead of 256.7 KB (``docs/guides/scaling.md``). The scores are the
    same (to round-off) for every attributor. K-FAC / EK-FAC, whose covariances ``A`` and
    ``G`` are made of the token factors, read them from the sums the store records at capture
    (per layer and checkpoint about ``(D² + K²) / 2`` numbers, whatever the number of samples; see
    ``docs/STORE_FORMAT.md``, "Kronecker statistics"). Token-level attribution
    (``attribution_granularity="token"``) needs the token axis of the train gradients: it is
    refused on a dense layer with an error naming ``keep_token_factors=True``, which keeps
    every layer's factors as captured (the larger store, with no recorded sums); a list of
    layer names keeps only those. The option lives here, not in
    ``HookManagerConfig``, because it is a storage choice: the capture, the in-memory records
    and live scoring are the same either way.

    Args:
        offload_interval: Write every ``offload_interval``-th step.
        file_manager: The store to write to: a ``GradientStorageManager``, or a directory
            path (a ``GradientStorageManager(path)`` is built for it).
        recording_type: ``"per_sample"`` or ``"per_batch"``.
        gradient_accumulation_steps: Micro-batches per optimizer step.
        step_offset: Added to every stored step. Default (``None``): ``0``, or, for a
            checkpoint label the store already holds records of (read when the callback is
            registered), whatever makes the first step follow the last stored one.
        keep_token_factors: ``False`` (default): compact storage (above). ``True``: every
            factorized layer is written with its factors and token axis. A list of layer names:
            only those, spelt as the store names them (``HookManager.layers``, without a
            DDP / compile wrapper's prefix); a name the hook manager does not capture is
            refused when the callback is registered, listing the captured ones.
        storage_dtype: ``None`` (default): floating tensors are stored in the dtype they were
            captured in (float32 for a float32 model). ``"float32"``, ``"bfloat16"`` or
            ``"float16"``: stored in that dtype (bf16 / fp16 halve a float32 store). Reads cast
            them back to the capture dtype (recorded in each shard), so scoring sees float32;
            the rank agreement of bf16 / fp16 scores with float32 ones is measured in
            ``docs/guides/scaling.md``. ``float16`` overflows above 65504; ``bfloat16``
            keeps float32's range. A record that holds ``inf`` / ``NaN`` as stored is refused
            by the store with an error naming the sample, the layer and the step, and whether
            the cast overflowed (then store in ``"bfloat16"`` or ``"float32"``) or the
            gradient was non-finite as captured (``GradientStorageManager(nonfinite=...)``).
        loss_reduction: ``None`` (default), ``"sum"`` or ``"mean"``: how the training loop's
            loss combined each batch (``"mean"`` for ``model(**batch).loss``), recorded in
            every record's metadata (:data:`LOSS_REDUCTION_KEY`). DVEmb and AdamW-influence
            read it from the store (their own ``loss_reduction=`` must then agree), so it is
            declared once, where the loop is written.

    Example:
        Three training steps offloaded to a store, read back:

        >>> import tempfile, torch
        >>> from dattri_llm import GradientStorageManager, HookManager, OffloadCallback
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        >>> store_dir = tempfile.mkdtemp()
        >>> store = GradientStorageManager(store_dir)
        >>> hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)])
        >>> with hm.collect(deregister_on_exit=True):
        ...     for step in range(3):  # three training steps of 4 samples each
        ...         model(torch.randn(4, 3)).pow(2).sum().backward()
        >>> store.close()
        >>> stored = GradientStorageManager(store_dir)
        >>> stored.num_samples, stored.available_steps()
        (12, [0, 1, 2])
    """

    def __init__(
        self,
        offload_interval: int = 1,
        file_manager: GradientStorageManager | str | os.PathLike | None = None,
        recording_type: str = "per_sample",
        gradient_accumulation_steps: int = 1,
        step_offset: int | None = None,
        keep_token_factors: bool | Sequence[str] = False,
        storage_dtype: str | torch.dtype | None = None,
        loss_reduction: str | None = None,
    ) -> None:
        if file_manager is None:
            raise ValueError(
                "OffloadCallback needs file_manager=GradientStorageManager(save_dir) (or the "
                "store's directory path): the store the gradients are written to."
            )
        if isinstance(file_manager, (str, os.PathLike)):
            from dattri_llm.gradient.store import GradientStorageManager

            file_manager = GradientStorageManager(file_manager)
        elif not callable(getattr(file_manager, "write", None)):
            raise TypeError(
                "OffloadCallback(file_manager=...) must be a GradientStorageManager or a "
                f"directory path, got {type(file_manager).__name__} {file_manager!r}."
            )
        if not isinstance(offload_interval, int) or offload_interval < 1:
            raise ValueError(f"offload_interval must be an integer >= 1, got {offload_interval!r}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError(
                "gradient_accumulation_steps must be an integer >= 1, got "
                f"{gradient_accumulation_steps!r}"
            )
        if step_offset is not None and (not isinstance(step_offset, int) or step_offset < 0):
            raise ValueError(f"step_offset must be an integer >= 0 or None, got {step_offset!r}")
        if recording_type not in ("per_sample", "per_batch"):
            raise ValueError(
                f"recording_type must be 'per_sample' or 'per_batch', got {recording_type!r}"
            )
        if loss_reduction not in (None, "sum", "mean"):
            raise ValueError(
                "OffloadCallback(loss_reduction=...) says how the training loss combined each "
                f"batch: 'sum', 'mean' or None (not recorded), got {loss_reduction!r}. Pass "
                "'mean' for model(**batch).loss or a reduction='mean' loss."
            )
        self.loss_reduction = loss_reduction
        self.keep_token_factors = check_keep_token_factors(keep_token_factors)
        self.storage_dtype = check_storage_dtype(storage_dtype)
        self.offload_interval = offload_interval
        self.file_manager = file_manager
        self.recording_type = recording_type
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.step_offset = step_offset
        self._stored_last: dict[int, int] = {}  # checkpoint -> last stored step at registration
        self._offsets: dict[int, int] = {}  # checkpoint -> offset of this capture
        self._batch: tuple[int, int, Gradient, list[str]] | None = None  # step, ckpt, sum, ids
        #: Number of records written so far.
        self.num_written = 0

    def _selected(self, step: int) -> bool:
        return step % self.offload_interval == 0

    def on_register(self, manager: Any) -> None:
        """Note the last stored step of each checkpoint label (steps continue after it).

        Raises:
            ValueError: ``keep_token_factors`` names a layer the manager does not capture.
        """
        super().on_register(manager)
        if isinstance(self.keep_token_factors, frozenset):
            # a name that is not a captured layer would keep nothing and make the later
            # token-level / K-FAC refusal name the option the user already passed
            check_names(
                "OffloadCallback(keep_token_factors=)",
                sorted(self.keep_token_factors),
                list(manager.layer_parameters()),
                "the layers the hook manager captures",
            )
        self.file_manager.refresh()
        self._stored_last = self.file_manager.last_steps()
        self._offsets = {}
        self.file_manager.configure(
            storage=storage_settings(self.keep_token_factors, self.storage_dtype)
        )
        self._record_coverage()

    def _record_coverage(self) -> None:
        """The share of trainable parameters captured, in ``meta.json`` (``inspect`` shows it).

        Set at registration and again before each write (the store's ``meta.json`` is written
        when its writer opens): after the first step it also drops the parameters found used
        outside their modules.
        """
        coverage = getattr(self.manager, "coverage", None)
        if callable(coverage):
            self.file_manager.configure(coverage=coverage().to_dict())

    def _statistics(self, gradient: Gradient) -> Gradient | None:
        """What the store's Kronecker statistics read of a record (``None``: nothing).

        Recorded when layers may be written densely (compact storage), from the factors as
        they would be stored (cast first), so the sums are those a fit over a factor store of
        the same dtype makes.
        """
        if self.keep_token_factors is True:
            return None
        return statistics_view(cast_gradient(gradient, self.storage_dtype))

    def _prepare(self, gradient: Gradient) -> tuple[Gradient, dict, Gradient]:
        """The gradient as stored, its ``storage`` header entry, and it before the cast.

        The store words its refusal of a non-finite value with the uncast gradient.
        """
        gradient, layers = compact_gradient(gradient, self.keep_token_factors)
        captured = str(gradient.dtype).removeprefix("torch.") if gradient.layers else None
        uncast = gradient
        gradient = cast_gradient(gradient, self.storage_dtype)
        stored = str(gradient.dtype).removeprefix("torch.") if gradient.layers else None
        return gradient, {"dtype": stored, "capture_dtype": captured, "layers": layers}, uncast

    def _stored_step(self, step: int, checkpoint: int) -> int:
        if checkpoint not in self._offsets:
            last = self._stored_last.get(checkpoint)
            if self.step_offset is not None:
                offset = self.step_offset
                if last is not None and step + offset <= last:
                    warnings.warn(
                        f"OffloadCallback(step_offset={offset}): step {step + offset} at "
                        f"checkpoint {checkpoint} is not after the last step already stored in "
                        f"{self.file_manager.save_dir} ({last}); the store now holds records of "
                        "two captures under the same step labels.",
                        UserWarning,
                        stacklevel=3,
                    )
            else:
                offset = 0 if last is None else max(0, last + 1 - step)
            self._offsets[checkpoint] = offset
        return step + self._offsets[checkpoint]

    def _metadata(self, record: GradientRecord | None) -> dict:
        meta = dict(record.metadata) if record is not None else {}
        if self.loss_reduction is not None:
            meta[LOSS_REDUCTION_KEY] = self.loss_reduction
        return meta

    def on_step_end(self, record: GradientRecord) -> None:
        """Write the record (or add it to the step's batch gradient)."""
        n = self.gradient_accumulation_steps
        step = record.step // n
        if not self._selected(step):
            return
        step = self._stored_step(step, record.checkpoint)
        self._record_coverage()
        if self.recording_type == "per_sample":
            gradient, storage, uncast = self._prepare(record.gradient)
            self.file_manager.write(
                GradientRecord(
                    step, list(record.hashes), gradient, record.checkpoint, self._metadata(record)
                ),
                storage=storage,
                uncast=uncast,
                statistics=self._statistics(record.gradient),
            )
            self.num_written += 1
            return
        if self._batch is not None and (self._batch[0], self._batch[1]) != (
            step,
            record.checkpoint,
        ):
            self._write_batch()
        agg = record.gradient.aggregate()
        if self._batch is None:
            self._batch = (step, record.checkpoint, agg, list(record.hashes))
        else:
            s, c, total, ids = self._batch
            summed = Gradient(
                {
                    name: type(lg)(lg.data + agg.layers[name].data, lg.layer_type, lg.module_kwargs)
                    for name, lg in total.layers.items()
                }
            )
            self._batch = (s, c, summed, ids + list(record.hashes))
        if record.step % n == n - 1:
            self._write_batch()

    def _write_batch(self) -> None:
        if self._batch is None:
            return
        step, ckpt, grad, ids = self._batch
        self._batch = None
        grad, storage, uncast = self._prepare(grad)  # already dense: only the dtype changes
        self.file_manager.write(
            GradientRecord(step, [batch_id(ids)], grad, ckpt, self._metadata(None)),
            extra={"members": ids},
            storage=storage,
            uncast=uncast,
        )
        self.num_written += 1

    def on_context_end(self) -> None:
        """Write a pending batch gradient, make every record durable, release the writer."""
        try:
            self._write_batch()
        finally:
            self.file_manager.close()

    def on_remove(self) -> None:
        """Flush the store and release its writer when the hooks come down."""
        try:
            self._write_batch()
        finally:
            self.file_manager.close()
