"""The unrolled sweeps refuse non-finite results instead of returning them.

A linearised step with negative curvature ``A = −c I`` under SGD multiplies the adjoint by
``1 + c·η`` per step (``δθ' = δθ − η A δθ``): the exact first-order scores are then
``4 η (1 + c η)^(n−1−k)`` for the occurrence at step ``k`` (a share of ones against a query of
ones, 4 coordinates), which pass float32's range within a few steps but not float64's.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm.attribution.trajectory.unroll import (
    Curvature,
    SGDStep,
    StepPushes,
    adjoint_sweep,
    forward_sweep,
)

C, LR, N = 1000.0, 1.0, 20


def _run(dtype: torch.dtype, share: float = 1.0):
    def load(step: int):
        curvature = Curvature(None, operator=lambda x: -C * x)
        shares = torch.full((1, 4), share, dtype=dtype)
        return SGDStep(curvature, lr=torch.tensor(LR, dtype=dtype)), StepPushes(
            step, shares, [f"s{step}"]
        )

    return list(range(N)), load


def test_amplifying_sweep_is_exact_in_float64():
    steps, load = _run(torch.float64)
    scores, hashes, rows = adjoint_sweep(steps, load, torch.ones(1, 4, dtype=torch.float64))
    want = torch.tensor(
        [[4 * LR * (1 + C * LR) ** (N - 1 - k)] for k in range(N)], dtype=torch.float64
    )
    assert rows == steps and hashes == [f"s{k}" for k in steps]
    torch.testing.assert_close(scores, want, rtol=1e-12, atol=0)
    emb, _, _ = forward_sweep(steps, load)
    torch.testing.assert_close(
        emb @ torch.ones(4, 1, dtype=torch.float64), want, rtol=1e-12, atol=0
    )


def test_overflowing_sweeps_are_refused_naming_the_step_and_the_fix():
    steps, load = _run(torch.float32)
    with pytest.raises(
        FloatingPointError, match=r"adjoint sweep: .* at step \d+ in torch\.float32"
    ):
        adjoint_sweep(steps, load, torch.ones(1, 4))
    with pytest.raises(FloatingPointError, match="compute_dtype=torch.float64"):
        forward_sweep(steps, load)


def test_non_finite_inputs_are_refused():
    steps, load = _run(torch.float64, share=float("nan"))
    with pytest.raises(FloatingPointError, match="inputs .* hold non-finite values"):
        adjoint_sweep(steps, load, torch.ones(1, 4, dtype=torch.float64))
