"""A cheap fingerprint of the weights a step was captured at, kept in each record's metadata.

Fixed-weights methods (Grad-Dot / Grad-Cos, TracIn per checkpoint, K-FAC / EK-FAC, LESS) read
all the records of one checkpoint label as gradients at *one* set of weights; a loop that
trains while capturing under one label (``HookManager.checkpoint`` never set) breaks that
silently. The score engine compares these fingerprints within a label and warns.

The fingerprint is a float64 sum over a fixed strided sample of at most
:data:`SAMPLES_PER_TENSOR` entries of every captured parameter (weighted by position, so that
swapped values differ): a few small reductions and one host sync per step, whatever the model
size. Two steps at the same weights always agree; an update that changes none of the sampled
entries is missed (updates of dense optimizers change every entry). Under FSDP each rank sees
its own shard, so the rank is part of the value and only fingerprints of one rank are compared.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dattri_llm.utils.distributed import get_rank

__all__ = ["METADATA_KEY", "SAMPLES_PER_TENSOR", "weights_fingerprint"]

METADATA_KEY = "weights_fingerprint"
SAMPLES_PER_TENSOR = 256


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)  # a DTensor (FSDP2): this rank's shard
    return to_local() if callable(to_local) else p


@torch.no_grad()
def weights_fingerprint(layers: Mapping[str, Mapping[str, torch.Tensor]]) -> str | None:
    """``"rank:hex"`` of the sampled entries of ``{layer: {name: parameter}}``; ``None`` if empty.

    Args:
        layers: The captured layers' parameters (``HookManager.layer_parameters()``).
    """
    parts = []
    for p in (p for params in layers.values() for p in params.values()):
        flat = _local(p).detach().reshape(-1)
        if flat.numel() == 0:
            continue
        stride = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        sample = flat[::stride][:SAMPLES_PER_TENSOR].to(torch.float64)
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
        parts.append((sample * weights).sum() + sample.sum())
    if not parts:
        return None
    return f"{get_rank()}:{float(torch.stack(parts).sum()).hex()}"
