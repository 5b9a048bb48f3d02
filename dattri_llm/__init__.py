"""dattri_llm: efficient training data attribution for LLM-scale models.

The capture core (hooks, gradients, callbacks, store) needs only torch. Attribution names are
imported lazily on first access, so ``import dattri_llm`` stays light.
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
    "HookCallback": "dattri_llm.gradient.callbacks",
    "CaptureCallback": "dattri_llm.gradient.callbacks",
    "hash_sample": "dattri_llm.utils.hashing",
    "hash_batch": "dattri_llm.utils.hashing",
}
# names provided by modules that may not exist yet in a partial checkout are added here by
# their owners: store, sources, streaming, projection, attribution.
_OPTIONAL_EXPORTS: dict[str, str] = {
    "GradientStorageManager": "dattri_llm.gradient.store",
    "OffloadCallback": "dattri_llm.gradient.callbacks",
    "KroneckerCovarianceCallback": "dattri_llm.gradient.callbacks",
    "OptimizerStateCallback": "dattri_llm.gradient.callbacks",
    "ParameterSnapshotCallback": "dattri_llm.gradient.callbacks",
    "DataSelectionCallback": "dattri_llm.gradient.callbacks",
    "GradientSource": "dattri_llm.gradient.sources",
    "DiskGradientSource": "dattri_llm.gradient.sources",
    "ReplayGradientSource": "dattri_llm.gradient.sources",
    "GradientStreamer": "dattri_llm.gradient.streaming",
    "ProjectionConfig": "dattri_llm.gradient.ops.projection",
    "AttributionArguments": "dattri_llm.attribution",
    "AttributionTask": "dattri_llm.attribution",
    "AttributionScore": "dattri_llm.attribution",
    "BaseAttributor": "dattri_llm.attribution",
    "TracInAttributor": "dattri_llm.attribution",
    "KFACAttributor": "dattri_llm.attribution",
    "EKFACAttributor": "dattri_llm.attribution",
    "LESSAttributor": "dattri_llm.attribution",
    "DVEmbAttributor": "dattri_llm.attribution",
    "AdamWInfluenceAttributor": "dattri_llm.attribution",
    "TrajectoryAttributor": "dattri_llm.attribution",
    "TrajectorySnapshots": "dattri_llm.attribution",
}


def _resolve(name: str) -> Any:
    module_name = _EXPORTS.get(name) or _OPTIONAL_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'dattri_llm' has no attribute {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if name in _OPTIONAL_EXPORTS and e.name and e.name.startswith("dattri_llm"):
            raise AttributeError(f"module 'dattri_llm' has no attribute {name!r}") from None
        raise
    if not hasattr(module, name):
        raise AttributeError(f"module 'dattri_llm' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __getattr__(name: str) -> Any:
    return _resolve(name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_OPTIONAL_EXPORTS))


__all__ = sorted(_EXPORTS)  # extended as optional modules land
