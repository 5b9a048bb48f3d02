"""Literal option types shared by signatures and documentation."""

from __future__ import annotations

from typing import Literal

__all__ = [
    "RoutingMode",
    "CaptureStyle",
    "HookType",
    "SimilarityMetric",
    "RecordingType",
    "ProjectionStyle",
    "AttributionGranularity",
    "similarity_metric",
]

#: How an inner product is evaluated; every mode is exact, only the cost differs.
RoutingMode = Literal["auto", "factorized", "materialized"]
#: What the backward hook buffers per layer and micro-batch.
CaptureStyle = Literal["factorized", "materialized", "auto"]
#: How a layer is hooked: per-sample factors, or the (per-batch) parameter gradient.
HookType = Literal["linear_io", "param_grad"]
#: Similarity between gradients (``"cos"`` is accepted as an alias of ``"cosine"``).
SimilarityMetric = Literal["dot", "cosine"]
_SIMILARITY_ALIASES = {"dot": "dot", "cosine": "cosine", "cos": "cosine"}
#: What OffloadCallback persists: every sample's gradient, or the batch sum.
RecordingType = Literal["per_sample", "per_batch"]
#: Capture-time random projection styles.
ProjectionStyle = Literal["logra", "dense", "mask", "sparse"]
#: One score per train sample, or per (train sample, train token position).
AttributionGranularity = Literal["sample", "token"]


def similarity_metric(value: str, name: str = "metric") -> str:
    """The canonical spelling of a similarity metric: ``"dot"`` or ``"cosine"``.

    Args:
        value: ``"dot"``, ``"cosine"`` or its alias ``"cos"``.
        name: The argument's name, for the error.

    Raises:
        ValueError: naming the argument and the accepted spellings.
    """
    if isinstance(value, str) and value in _SIMILARITY_ALIASES:
        return _SIMILARITY_ALIASES[value]
    raise ValueError(f"{name} must be 'dot' or 'cosine' (alias 'cos'), got {value!r}.")
