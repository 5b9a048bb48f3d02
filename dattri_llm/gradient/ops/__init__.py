"""Operations on captured gradients: routed inner products, cost model, projection."""

from __future__ import annotations

from dattri_llm.gradient.ops.inner import (
    cross_dot,
    cross_dot_per_token,
    dot,
    grad_norm_sq,
    layer_cross_dot,
    layer_cross_dot_per_token,
    materialize,
    pairwise_dot,
)
from dattri_llm.gradient.ops.projection import ProjectionConfig, project_gradient
from dattri_llm.gradient.ops.routing import (
    materialized_gram_cheaper,
    maybe_use_materialized_gram,
    maybe_use_materialized_norm,
    should_materialize,
)

__all__ = [
    "dot",
    "pairwise_dot",
    "cross_dot",
    "cross_dot_per_token",
    "grad_norm_sq",
    "materialize",
    "layer_cross_dot",
    "layer_cross_dot_per_token",
    "maybe_use_materialized_gram",
    "maybe_use_materialized_norm",
    "materialized_gram_cheaper",
    "should_materialize",
    "ProjectionConfig",
    "project_gradient",
]
