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
]

#: How an inner product is evaluated; every mode is exact, only the cost differs.
RoutingMode = Literal["auto", "factorized", "materialized"]
#: What the backward hook buffers per layer and micro-batch.
CaptureStyle = Literal["factorized", "materialized", "auto"]
#: How a layer is hooked: per-sample factors, or the (per-batch) parameter gradient.
HookType = Literal["linear_io", "param_grad"]
#: Similarity between gradients.
SimilarityMetric = Literal["dot", "cosine"]
#: What OffloadCallback persists: every sample's gradient, or the batch sum.
RecordingType = Literal["per_sample", "per_batch"]
#: Capture-time random projection styles.
ProjectionStyle = Literal["logra", "dense", "mask"]
#: One score per train sample, or per (train sample, train token position).
AttributionGranularity = Literal["sample", "token"]
