"""The write-time check that a store holds only finite gradients.

A non-finite gradient (``inf`` / ``NaN``) makes every score it enters ``NaN`` or infinite, so
it is refused when written, not found when ranked. Two causes, told apart in the error:

* the gradient was already non-finite as captured (a diverged step: a NaN / inf loss);
* a finite gradient overflowed on the cast to a narrower ``storage_dtype``: ``float16`` holds
  at most ``65504``; ``bfloat16`` has float32's range and cannot overflow a float32 capture.

:func:`find_nonfinite` locates the first non-finite number of a gradient (one sync per record
in the common, finite case); :func:`nonfinite_error` words the refusal, naming the sample (its
hash), the layer and the record (step, checkpoint).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.layer_gradient import LayerGradient

__all__ = [
    "NONFINITE_MODES",
    "NonFinite",
    "NonFiniteGradientError",
    "find_nonfinite",
    "nonfinite_error",
]

#: What ``GradientStorageManager(nonfinite=...)`` takes.
NONFINITE_MODES = ("error", "warn")


class NonFiniteGradientError(ValueError):
    """A record to be written holds a non-finite (``inf`` / ``NaN``) gradient value."""


class NonFinite(NamedTuple):
    """Where a gradient first holds a non-finite number.

    Attributes:
        layer: The layer's name.
        row: The sample's row in the record (its index into ``record.hashes``).
        tensor: Which of the layer's floating tensors (in ``LayerGradient.apply`` order).
        value: The first non-finite value of that row (``inf``, ``-inf`` or ``nan``).
    """

    layer: str
    row: int
    tensor: int
    value: float


def _floating(lg: LayerGradient) -> list[torch.Tensor]:
    """The layer's floating tensors, batch axis first (integer index factors left out)."""
    found: list[torch.Tensor] = []

    def see(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            found.append(t)
        return t

    lg.apply(see)
    return found


def _sum_dtype(t: torch.Tensor) -> torch.dtype:
    """Sum half dtypes in float32: their own range (float16: 65504) would overflow often."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def find_nonfinite(gradient: Gradient) -> NonFinite | None:
    """The first non-finite number of ``gradient`` (layers in order), or ``None``."""
    layers = [(name, _floating(lg)) for name, lg in gradient.layers.items()]
    # A sum is non-finite whenever one of its terms is (NaN and inf propagate; inf - inf is
    # NaN): one reduction, with no mask, clears a finite tensor ~30x faster than isfinite().
    # A finite tensor whose sum overflows only costs the exact scan below, which returns None.
    flags = [torch.isfinite(t.sum(dtype=_sum_dtype(t))) for _, ts in layers for t in ts]
    if not flags or bool(torch.stack([f.to(flags[0].device) for f in flags]).all()):
        return None  # the common case: one sync for the whole record
    for name, tensors in layers:
        for j, t in enumerate(tensors):
            bad = ~torch.isfinite(t.reshape(t.shape[0], -1))
            rows = bad.any(dim=1).nonzero()
            if rows.numel():
                row = int(rows[0])
                value = float(t.reshape(t.shape[0], -1)[row][bad[row]][0])
                return NonFinite(name, row, j, value)
    return None  # finite numbers whose sum overflowed


def nonfinite_error(
    record: GradientRecord, found: NonFinite, uncast: Gradient | None = None
) -> NonFiniteGradientError:
    """The refusal of ``record``, naming the sample, the layer and the record.

    Args:
        record: The record as it would be stored.
        found: :func:`find_nonfinite` of ``record.gradient``.
        uncast: The same gradient before its cast to the storage dtype, if it was cast: it
            tells an overflow of the cast from a value that was already non-finite.
    """
    h = record.hashes[found.row] if found.row < len(record.hashes) else f"row {found.row}"
    where = (
        f"the gradient of sample {h!r} (row {found.row} of the record at step {record.step}, "
        f"checkpoint {record.checkpoint}) in layer {found.layer!r} is {found.value}"
    )
    stored = record.gradient.layers[found.layer]
    dtype = _floating(stored)[found.tensor].dtype
    name = str(dtype).removeprefix("torch.")
    before = None
    if uncast is not None and found.layer in uncast.layers:
        tensors = _floating(uncast.layers[found.layer])
        if found.tensor < len(tensors) and tensors[found.tensor].dtype != dtype:
            before = tensors[found.tensor][found.row]
    if before is not None and bool(torch.isfinite(before).all()):
        wide = str(before.dtype).removeprefix("torch.")
        return NonFiniteGradientError(
            f"{where} as stored in {name}: it was finite as captured in {wide} (largest "
            f"|value| {float(before.abs().max()):.4g}) and overflowed on the cast, {name} "
            f"holding at most {torch.finfo(dtype).max:.6g}. Store in "
            "storage_dtype='bfloat16' (float32's range, the same size as float16) or "
            "'float32' (OffloadCallback(storage_dtype=...))."
        )
    cause = (
        f"it was already non-finite before the cast to {name}"
        if before is not None
        else f"it is non-finite as given (stored in {name})"
    )
    return NonFiniteGradientError(
        f"{where}: {cause}, so every score it enters would be NaN or infinite. The training "
        "step diverged (check the loss for inf / NaN: a lower learning rate, gradient "
        "clipping, or loss scaling fixes it), or the gradient was computed in a dtype too "
        "narrow for it; a float16 capture can overflow where storage_dtype='bfloat16' or "
        "'float32' of a float32 capture cannot. To write it anyway (its scores then rank "
        "after every finite one), open the store with "
        "GradientStorageManager(save_dir, nonfinite='warn')."
    )
