"""LDS / LOO with dattri 0.3.0's metrics (mean over test samples of the per-sample Spearman /
Pearson correlation, NaN dropped), a 95 % percentile bootstrap interval over test samples, and
the ground truth's split-run reliability."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata

N_BOOT = 400


def _colwise_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of every column of ``a`` with the same column of ``b``."""
    a, b = a - a.mean(0, keepdims=True), b - b.mean(0, keepdims=True)
    den = np.sqrt((a * a).sum(0) * (b * b).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(0) / np.where(den > 0, den, 1.0), np.nan)


def spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-column Spearman (average ranks for ties), as ``scipy.stats.spearmanr``."""
    return _colwise_corr(rankdata(a, axis=0), rankdata(b, axis=0))


def summary(per_test: np.ndarray, seed: int = 0) -> dict:
    """``nanmean(per_test)`` with its 95 % percentile bootstrap interval over test samples."""
    v, lo, hi = per_test[~np.isnan(per_test)], np.nan, np.nan
    if len(v):
        means = v[np.random.default_rng(seed).integers(0, len(v), (N_BOOT, len(v)))].mean(1)
        lo, hi = np.percentile(means, [2.5, 97.5])
    nan = int(np.isnan(per_test).sum())
    return {"mean": float(np.nanmean(per_test)), "lo": float(lo), "hi": float(hi), "nan": nan}


def lds_metric(scores: torch.Tensor, gt: dict[str, torch.Tensor], seed: int = 0) -> dict:
    """dattri's LDS plus a bootstrap interval. ``scores``: (n_train, n_test)."""
    from dattri.metric import lds

    return summary(lds(scores.to(torch.float64), (gt["gt"], gt["indices"]))[0].numpy(), seed)


def loo_metric(scores: torch.Tensor, gt: dict[str, torch.Tensor], seed: int = 0) -> dict:
    """dattri's ``loo_corr`` on the removed samples' rows, taken in ``gt['indices']`` order
    first (it pairs score row ``k`` with model ``k``, ignoring its index tensor)."""
    from dattri.metric import loo_corr

    rows = scores[gt["indices"].long()].to(torch.float64)
    return summary(loo_corr(rows, (gt["gt"], gt["indices"]))[0].numpy(), seed)


def split_run_reliability(per_run: torch.Tensor, seed: int = 0) -> dict:
    """Spearman between run 0 and run 1 of the same subsets, per test sample, averaged: the
    ceiling against a single run (``mean_avg``: Spearman-Brown for the mean of ``R`` runs)."""
    out = summary(spearman_columns(per_run[:, 0].numpy(), per_run[:, 1].numpy()), seed)
    r, _, k = out.pop("mean"), out.pop("nan"), per_run.shape[1]
    mean_avg = k * r / (1 + (k - 1) * r) if r > -1 / (k - 1) else float("nan")
    return {"mean": r, **out, "runs": k, "mean_avg": mean_avg}


def loo_corr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over test columns of the Pearson correlation across removed samples (rows)."""
    return float(np.nanmean(_colwise_corr(a, b)))
