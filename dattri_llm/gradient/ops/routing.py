"""The cost model that routes inner products between factorised and materialised evaluation.

For a layer with input width ``D``, output width ``K`` and ``S`` tokens per sample:

* a Gram block between ``B1`` and ``B2`` samples costs ``B1 B2 S^2 (D + K)`` flops factorised,
  and ``(B1 + B2) S D K`` (forming the gradients) ``+ B1 B2 D K`` (the GEMM) materialised;
* a per-sample squared norm costs ``S^2 (D + K)`` factorised and ``S D K + D K`` materialised,
  i.e. materialise when ``S >= D K / (D + K)``;
* at capture, the dense gradient (``D K`` numbers) is smaller than the factors
  (``S (D + K)``) under the same threshold.
"""

from __future__ import annotations

__all__ = [
    "maybe_use_materialized_gram",
    "maybe_use_materialized_norm",
    "should_materialize",
    "materialized_gram_cheaper",
]


def maybe_use_materialized_gram(b1: int, b2: int, s: int, k: int, d: int) -> bool:
    """True iff ``B1 B2 S^2 (D+K) >= (B1+B2) S D K + B1 B2 D K`` (materialise-then-GEMM)."""
    return b1 * b2 * s * s * (d + k) >= (b1 + b2) * s * d * k + b1 * b2 * d * k


def materialized_gram_cheaper(b1: int, b2: int, s1: int, s2: int, k: int, d: int) -> bool:
    """:func:`maybe_use_materialized_gram` for two sides with different token counts."""
    return b1 * b2 * s1 * s2 * (d + k) >= (b1 * s1 + b2 * s2) * d * k + b1 * b2 * d * k


def maybe_use_materialized_norm(s: int, k: int, d: int) -> bool:
    """True iff ``S >= D K / (D + K)``: materialise to compute per-sample norms."""
    return s * (d + k) >= d * k


def should_materialize(s: int, k: int, d: int) -> bool:
    """Capture-time choice: True iff the dense gradient (``D K``) is no larger than the factors."""
    return d * k <= s * (d + k)
