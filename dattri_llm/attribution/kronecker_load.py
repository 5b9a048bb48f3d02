"""Loading a saved K-FAC / EK-FAC fit or saved covariances (safetensors + JSON, validated)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dattri_llm.gradient.ops.kronecker import KroneckerCovariances, KroneckerFactors

__all__ = ["load_factors", "load_covariances"]

_FACTORS_JSON = "kronecker_factors.json"
_COV_JSON = "kronecker_covariances.json"


def load_factors(obj: Any) -> dict[int, KroneckerFactors]:
    """``{checkpoint: KroneckerFactors}`` from a fit, a dict of fits or a saved directory."""
    if isinstance(obj, KroneckerFactors):
        return {0: obj}
    if isinstance(obj, Mapping):
        out = {}
        for c, f in obj.items():
            if not isinstance(f, KroneckerFactors):
                raise TypeError(
                    f"factors[{c!r}] must be a KroneckerFactors, got {type(f).__name__}."
                )
            out[int(c)] = f
        return out
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if os.path.exists(os.path.join(path, _FACTORS_JSON)):
            return {0: KroneckerFactors.load(path)}
        subs = (
            sorted(d for d in os.listdir(path) if d.startswith("checkpoint_"))
            if os.path.isdir(path)
            else []
        )
        if not subs:
            raise FileNotFoundError(
                f"{path} holds no saved Kronecker factors (expected "
                f"{_FACTORS_JSON} or checkpoint_<c>/ folders)."
            )
        return {int(d.split("_", 1)[1]): KroneckerFactors.load(os.path.join(path, d)) for d in subs}
    raise TypeError(
        f"factors must be a directory, a KroneckerFactors or a dict of them, got "
        f"{type(obj).__name__}."
    )


def load_covariances(obj: Any) -> dict[int, KroneckerCovariances]:
    """``{checkpoint: KroneckerCovariances}`` from a callback, covariances, a directory, a dict."""
    if isinstance(obj, Mapping):
        return {int(c): _one_cov(v) for c, v in obj.items()}
    return {0: _one_cov(obj)}


def _one_cov(obj: Any) -> KroneckerCovariances:
    if isinstance(obj, KroneckerCovariances):
        return obj
    cov = getattr(obj, "covariances", None)  # a KroneckerCovarianceCallback
    if isinstance(cov, KroneckerCovariances):
        return cov
    if isinstance(obj, (str, os.PathLike)):
        if not os.path.exists(os.path.join(obj, _COV_JSON)):
            raise FileNotFoundError(f"{obj} holds no saved covariances ({_COV_JSON}).")
        return KroneckerCovariances.load(obj)
    raise TypeError(
        "covariances must be a KroneckerCovarianceCallback, KroneckerCovariances, "
        f"a directory or a dict of them, got {type(obj).__name__}."
    )
