"""dattri_llm: efficient training data attribution for LLM-scale models.

The capture core (hooks, gradients, callbacks, store) needs only torch. Every public name is
imported lazily on first access, so ``import dattri_llm`` stays light and the attribution
layer is loaded only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    # capture core
    "HookManager": "dattri_llm.gradient.hooks",
    "HookManagerConfig": "dattri_llm.gradient.hooks",
    "REGISTER_ALL": "dattri_llm.gradient.hooks",
    "Gradient": "dattri_llm.gradient.gradient",
    "GradientRecord": "dattri_llm.gradient.gradient",
    "Factorized": "dattri_llm.gradient.gradient",
    "Materialized": "dattri_llm.gradient.gradient",
    "Shared": "dattri_llm.gradient.gradient",
    "ProjectionConfig": "dattri_llm.gradient.ops.projection",
    # callbacks
    "HookCallback": "dattri_llm.gradient.callbacks",
    "CaptureCallback": "dattri_llm.gradient.callbacks",
    "OffloadCallback": "dattri_llm.gradient.callbacks",
    "KroneckerCovarianceCallback": "dattri_llm.gradient.callbacks",
    "DataSelectionCallback": "dattri_llm.gradient.callbacks.data_selection",
    "OptimizerStateCallback": "dattri_llm.gradient.callbacks.optimizer_state",
    "ParameterSnapshotCallback": "dattri_llm.gradient.callbacks.parameter_snapshot",
    # training trajectories
    "TrajectorySnapshots": "dattri_llm.gradient.trajectory",
    "OptimizerDynamics": "dattri_llm.gradient.trajectory",
    "ReplayGradientSource": "dattri_llm.gradient.trajectory",
    # store and sources
    "GradientStorageManager": "dattri_llm.gradient.store",
    "GradientSource": "dattri_llm.gradient.sources",
    "GradientBlock": "dattri_llm.gradient.sources",
    "DiskGradientSource": "dattri_llm.gradient.sources",
    "InMemoryGradientSource": "dattri_llm.gradient.sources",
    "GradientStreamer": "dattri_llm.gradient.streaming",
    # attribution
    "AttributionArguments": "dattri_llm.attribution",
    "AttributionTask": "dattri_llm.attribution",
    "AttributionScore": "dattri_llm.attribution",
    "BaseAttributor": "dattri_llm.attribution",
    "TracInAttributor": "dattri_llm.attribution",
    "KFACAttributor": "dattri_llm.attribution",
    "EKFACAttributor": "dattri_llm.attribution",
    "ProjectedFisherAttributor": "dattri_llm.attribution",
    "LESSAttributor": "dattri_llm.attribution",
    "TrajectoryAttributor": "dattri_llm.attribution",
    "AdamWInfluenceAttributor": "dattri_llm.attribution",
    "DVEmbAttributor": "dattri_llm.attribution",
    "DataValueEmbeddings": "dattri_llm.attribution",
    "ExactHessian": "dattri_llm.attribution",
    "LiveRunArguments": "dattri_llm.attribution",
    "SecondMoment": "dattri_llm.attribution",
    "GradientIndex": "dattri_llm.attribution",
    "Explorer": "dattri_llm.attribution.explorer",
    # training frameworks (imported on first access; need their extras)
    "AttributionCallback": "dattri_llm.integrations.hf_trainer",
    "capture_queries": "dattri_llm.integrations.hf_trainer",
    # sample identity
    "hash_sample": "dattri_llm.utils.hashing",
    "hash_batch": "dattri_llm.utils.hashing",
}


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'dattri_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
