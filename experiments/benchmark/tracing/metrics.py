"""Retrieval metrics and confidence intervals of the fact-tracing benchmark.

``scores`` are ``(n_docs, n_queries)`` with larger = more responsible; ties are broken by
document index (stable sort), so a constant score column ranks documents in index order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def rankings(scores: torch.Tensor) -> torch.Tensor:
    """``(n_queries, n_docs)`` document indices, best first, per query column of ``scores``."""
    if torch.isnan(scores).any():
        raise ValueError("scores contain NaN: a method returned an incomplete score matrix")
    return torch.sort(-scores.t().double(), dim=1, stable=True).indices


def recall_at_k(scores: torch.Tensor, relevant: Sequence[set[int]], k: int) -> torch.Tensor:
    """Per query, the fraction of its relevant documents found in its top ``k``."""
    top = rankings(scores)[:, :k].tolist()
    return torch.tensor(
        [len(rel.intersection(t)) / len(rel) for t, rel in zip(top, relevant)], dtype=torch.float64
    )


def reciprocal_rank(scores: torch.Tensor, relevant: Sequence[set[int]]) -> torch.Tensor:
    """Per query, ``1 / rank`` of its first relevant document (ranks start at 1)."""
    out = []
    for order, rel in zip(rankings(scores).tolist(), relevant):
        first = next(i for i, d in enumerate(order) if d in rel)
        out.append(1.0 / (first + 1))
    return torch.tensor(out, dtype=torch.float64)


def top_k(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per query, its ``k`` best documents."""
    return rankings(scores)[:, :k].tolist()


def mean_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95 % interval (``z * sd / √n``)."""
    x = np.asarray(values, dtype=np.float64)
    half = z * x.std(ddof=1) / math.sqrt(x.size) if x.size > 1 else math.nan
    return float(x.mean()), float(half)
