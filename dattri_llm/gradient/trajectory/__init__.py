"""Training trajectories: snapshots on disk, optimizer dynamics, and replayed gradients."""

from __future__ import annotations

from dattri_llm.gradient.trajectory.dynamics import OptimizerDynamics, StepDynamics
from dattri_llm.gradient.trajectory.replay import ReplayGradientSource
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

__all__ = ["TrajectorySnapshots", "OptimizerDynamics", "StepDynamics", "ReplayGradientSource"]
