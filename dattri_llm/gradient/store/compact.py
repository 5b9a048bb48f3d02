"""Compact storage of a captured step: per layer, the smaller of its two exact forms.

A layer's per-sample gradient can be written as its factors (``a``, ``g`` with their token
axis) or as the dense per-sample gradient (``(B, K*D)``, the layer's matrix form; for a
projected ``logra`` layer ``(B, k*d)``). Both are exact; which one is smaller depends on the
token count ``T`` and the widths, so it is decided per record and per layer from the actual
tensors: the bytes the factors would take on disk against the bytes of the dense form, in the
storage dtype. Factors are kept only where they are no larger, or where the caller asks for
them (``keep_token_factors``): token-level attribution and K-FAC covariance fits from a store
need the token axis.

A tied (:class:`~dattri_llm.gradient.layer_gradient.Shared`) layer's dense form is the sum of its
sites (one ``(B, P)`` tensor), written as a plain materialized layer when it is smaller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.layer_gradient import Factorized, LayerGradient, Shared

__all__ = [
    "STORAGE_DTYPES",
    "KEEP_OPTION",
    "check_storage_dtype",
    "check_keep_token_factors",
    "storage_settings",
    "layer_form_bytes",
    "compact_gradient",
    "cast_gradient",
]

#: The dtypes a store can hold its floating tensors in.
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: How the option that keeps the token axis is spelled in error messages.
KEEP_OPTION = "OffloadCallback(keep_token_factors=True)"


def check_storage_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """Validate ``storage_dtype`` (``None``: the dtype the gradients were captured in).

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value not in STORAGE_DTYPES:
        raise ValueError(
            f"storage_dtype must be None (keep the capture dtype) or one of "
            f"{sorted(STORAGE_DTYPES)}, got {value!r}."
        )
    return STORAGE_DTYPES[value]


def check_keep_token_factors(value: bool | Sequence[str]) -> bool | frozenset[str]:
    """Validate ``keep_token_factors``: a bool, or the names of the layers to keep factorized.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not isinstance(value, Sequence | set | frozenset):
        raise TypeError(
            f"keep_token_factors must be True / False or a list of layer names, got {value!r}."
        )
    names = frozenset(value)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"keep_token_factors: layer names must be strings, got {sorted(names)!r}.")
    return names


def storage_settings(keep: bool | frozenset[str], dtype: torch.dtype | None) -> dict[str, Any]:
    """The storage choices as a partition's ``meta.json`` records them (``"storage"``).

    Args:
        keep: ``keep_token_factors`` as :func:`check_keep_token_factors` returns it.
        dtype: ``storage_dtype`` as :func:`check_storage_dtype` returns it.
    """
    return {
        "compact": keep is not True,
        "keep_token_factors": keep if isinstance(keep, bool) else sorted(keep),
        "storage_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
    }


def _stored_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    size = t.element_size() if dtype is None or not t.is_floating_point() else dtype.itemsize
    return t.numel() * size


def _float_dtype(lg: LayerGradient) -> torch.dtype:
    site = lg.sites[0] if isinstance(lg, Shared) else lg
    return site.g.dtype if isinstance(site, Factorized) else site.data.dtype


def layer_form_bytes(lg: LayerGradient, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """``(bytes as stored now, bytes of the dense form)`` of one layer in ``dtype``.

    ``dtype`` ``None`` counts in the tensors' own dtype (integer index factors keep theirs).
    """
    sites = lg.sites if isinstance(lg, Shared) else [lg]
    now = 0
    for s in sites:
        if isinstance(s, Factorized):
            now += _stored_nbytes(s.a, dtype) + _stored_nbytes(s.g, dtype)
        else:
            now += _stored_nbytes(s.data, dtype)
    k, d = lg.rule.matrix_shape(lg.module_kwargs)
    item = (dtype or _float_dtype(lg)).itemsize
    return now, lg.batch_size * k * d * item


def _has_factors(lg: LayerGradient) -> bool:
    sites = lg.sites if isinstance(lg, Shared) else [lg]
    return any(isinstance(s, Factorized) for s in sites)


def compact_gradient(
    gradient: Gradient, keep_token_factors: bool | frozenset[str] = False
) -> tuple[Gradient, dict[str, str]]:
    """Each layer in the smaller of its exact forms (factors kept on ties and when asked).

    Args:
        gradient: A captured step.
        keep_token_factors: ``True`` keeps every layer as captured; a set of names keeps
            those layers as captured.

    Returns:
        ``(gradient, choices)``; ``choices[name]`` is ``"factors"`` (kept with the token
        axis), ``"dense"`` (materialized here because it is smaller), ``"kept"`` (factors kept
        because ``keep_token_factors`` asks for them) or ``"captured dense"`` (the capture
        already materialized it).
    """
    out: dict[str, LayerGradient] = {}
    choices: dict[str, str] = {}
    for name, lg in gradient.layers.items():
        if not _has_factors(lg):
            out[name], choices[name] = lg, "captured dense"
        elif keep_token_factors is True or (
            isinstance(keep_token_factors, frozenset) and name in keep_token_factors
        ):
            out[name], choices[name] = lg, "kept"
        else:
            now, dense = layer_form_bytes(lg)
            if dense < now:
                out[name], choices[name] = lg.materialize(), "dense"
            else:
                out[name], choices[name] = lg, "factors"
    return Gradient(out), choices


def cast_gradient(gradient: Gradient, dtype: torch.dtype | None) -> Gradient:
    """Floating tensors in ``dtype`` (integer index factors keep theirs); ``None``: unchanged."""
    if dtype is None:
        return gradient

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return Gradient({name: lg.apply(cast) for name, lg in gradient.layers.items()})
