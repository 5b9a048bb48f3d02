"""The routing cost model, exactly as the specification states it, and its boundaries."""

from __future__ import annotations

import itertools

from dattri_llm.gradient import ops


def spec_gram(b1: int, b2: int, s: int, k: int, d: int) -> bool:
    return b1 * b2 * s * s * (d + k) >= (b1 + b2) * s * d * k + b1 * b2 * d * k


def test_gram_rule_matches_spec_on_a_grid() -> None:
    for b1, b2, s, k, d in itertools.product(
        [1, 2, 8], [1, 3], [1, 4, 64, 512], [1, 16, 768], [1, 32, 768]
    ):
        assert ops.maybe_use_materialized_gram(b1, b2, s, k, d) == spec_gram(b1, b2, s, k, d)
        assert ops.materialized_gram_cheaper(b1, b2, s, s, k, d) == spec_gram(b1, b2, s, k, d)


def test_gram_rule_boundary_is_inclusive() -> None:
    # B1=B2=1, K=D=2: S^2*4 >= 2*S*4 + 4  <=>  S^2 - 2S - 1 >= 0: S=3 is the first True
    assert not ops.maybe_use_materialized_gram(1, 1, 2, 2, 2)
    assert ops.maybe_use_materialized_gram(1, 1, 3, 2, 2)
    # B1=B2=1, K=D=1: S=2 gives 8 >= 5 (True), S=1 gives 2 >= 3 (False)
    assert ops.maybe_use_materialized_gram(1, 1, 2, 1, 1)
    assert not ops.maybe_use_materialized_gram(1, 1, 1, 1, 1)


def test_norm_rule_threshold() -> None:
    # S >= DK/(D+K): D=K=4 -> threshold 2 (inclusive)
    assert not ops.maybe_use_materialized_norm(1, 4, 4)
    assert ops.maybe_use_materialized_norm(2, 4, 4)
    assert ops.maybe_use_materialized_norm(3, 3, 6)  # 18/9 = 2 <= 3
    assert not ops.maybe_use_materialized_norm(1, 3, 6)
    for s, k, d in itertools.product(range(1, 40), [1, 7, 64], [1, 5, 128]):
        assert ops.maybe_use_materialized_norm(s, k, d) == (s >= d * k / (d + k))


def test_capture_rule_materializes_when_dense_is_smaller() -> None:
    assert ops.should_materialize(s=512, k=64, d=64)  # 4096 numbers vs 65536
    assert not ops.should_materialize(s=4, k=768, d=768)
    assert ops.should_materialize(s=2, k=2, d=2)  # 4 <= 8
