"""Ranking scores: the rule every top-k path follows, and the checks of ``k``.

NaN rule. A score is ``NaN`` when the gradients behind it were not finite (a diverged step, a
store written before non-finite gradients were refused) or when ``inf - inf`` met in a sum. A
NaN is not a large or a small influence, so it is never ranked as one: on both lists
(proponents, largest first; opponents, smallest first) a NaN score ranks after every other
score, ``±inf`` included. :func:`rank` is that rule, and every top-k path ranks through it:
``AttributionScore.top_k`` of a full matrix (a list holds a NaN only where a query has fewer
than ``k`` other scores; a warning names one), the streamed top-k of the score loop (the
general loop and the vector fast path share its sink, whose empty slots rank before a NaN, so
it never keeps one; a warning names the first), the merge of ranks' top-k, and
:class:`~dattri_llm.attribution.index.GradientIndex` (which, FAISS having no order for NaN,
also refuses non-finite vectors at build and search).

Size rule. ``k`` (``top_k=``) is a positive int; a ``k`` larger than the number of train
samples means "every sample" and is clamped to that number before anything is allocated
(:func:`clamp_top_k`), so ``top_k=10**12`` on a small store is every sample, ranked.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_top_k", "clamp_top_k", "rank"]


def check_top_k(top_k: Any, name: str = "top_k") -> int | None:
    """Validate a ``top_k=`` argument (``None``: the full matrix).

    Raises:
        ValueError: naming ``name`` and what it takes.
    """
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{name} must be a positive int (or None for every score), got {top_k!r}.")
    return int(top_k)


def clamp_top_k(k: int, num_train: int) -> int:
    """``k`` limited to ``num_train`` samples (at least 1: an empty set keeps a valid ``k``)."""
    return max(1, min(int(k), int(num_train)))


def rank(
    values: torch.Tensor, k: int, largest: bool = True, *, has_nan: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``k`` largest (or smallest) values and their columns, NaN after all others.

    Args:
        values: ``(R, N)`` scores.
        k: How many per row (clamped to ``N``).
        largest: ``True``: descending (proponents); ``False``: ascending (opponents).
        has_nan: Whether ``values`` holds a NaN, when the caller knows (``None``: looked up).

    Returns:
        ``(values, columns)``, each ``(R, min(k, N))``, the values as given (a NaN stays NaN).
    """
    k = min(int(k), values.shape[1])
    if has_nan is None:
        has_nan = bool(values.isnan().any())
    if not has_nan:
        return values.topk(k, dim=1, largest=largest)
    nan = values.isnan()
    # two stable sorts: by value (NaN stands in as 0, any value would do), then NaN last
    order = values.masked_fill(nan, 0).sort(dim=1, descending=largest, stable=True).indices
    last = nan.gather(1, order).to(torch.int8).sort(dim=1, stable=True).indices
    pos = order.gather(1, last)[:, :k]
    return values.gather(1, pos), pos
