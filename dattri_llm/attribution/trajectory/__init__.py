"""The machinery of the trajectory methods.

The shared base of the methods that replay a recorded training run
(:class:`TrajectoryAttributor`), the linearised optimizer steps and their sweeps (``unroll``),
curvature inside a step (``curvature``) and the live path's recorded run (``training``). The
methods themselves (``adamw_influence``, ``dvemb``) sit one level up.
"""

from __future__ import annotations

from dattri_llm.attribution.trajectory.base import (
    StepIndex,
    TrajectoryAttributor,
    as_schedule,
    dense_rows,
    step_index,
)

__all__ = ["TrajectoryAttributor", "StepIndex", "step_index", "as_schedule", "dense_rows"]
