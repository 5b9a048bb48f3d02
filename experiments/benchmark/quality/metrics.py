"""LDS / LOO with dattri 0.3.0's metrics, bootstrap intervals, and ground-truth reliability.

Point estimates are exactly ``dattri.metric.lds`` / ``dattri.metric.loo_corr`` (mean over test
samples of the per-sample Spearman / Pearson correlation, NaN dropped). The 95 % interval is a
percentile bootstrap that resamples the retrained models (subsets / removed samples) *and*
the test samples, so it covers both the finite ground truth and the finite test set; it is
computed with a vectorised rank correlation equal to dattri's on the unresampled data.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata

N_BOOT = 400


def _colwise_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of every column of ``a`` with the same column of ``b``."""
    a = a - a.mean(0, keepdims=True)
    b = b - b.mean(0, keepdims=True)
    den = np.sqrt((a * a).sum(0) * (b * b).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (a * b).sum(0) / np.where(den > 0, den, 1.0), np.nan)


def spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-column Spearman (average ranks for ties), as ``scipy.stats.spearmanr``."""
    return _colwise_corr(rankdata(a, axis=0), rankdata(b, axis=0))


def bootstrap_ci(per_test: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of ``nanmean(per_test)`` over test samples."""
    v = per_test[~np.isnan(per_test)]
    if len(v) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), (N_BOOT, len(v)))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def lds_metric(scores: torch.Tensor, gt: dict[str, torch.Tensor], seed: int = 0) -> dict:
    """dattri's LDS plus a bootstrap interval. ``scores``: (n_train, n_test)."""
    from dattri.metric import lds

    per_test, _ = lds(scores.to(torch.float64), (gt["gt"], gt["indices"]))
    value = float(np.nanmean(per_test.numpy()))
    lo, hi = bootstrap_ci(per_test.numpy(), seed)
    return {"mean": value, "lo": lo, "hi": hi, "nan": int(np.isnan(per_test.numpy()).sum())}


def loo_metric(scores: torch.Tensor, gt: dict[str, torch.Tensor], seed: int = 0) -> dict:
    """dattri's ``loo_corr`` on the rows of the removed samples (row order = ``gt['indices']``).

    ``loo_corr`` ignores its index tensor and pairs score row ``k`` with model ``k``, so the
    score rows are selected in the order of the removed indices first.
    """
    from dattri.metric import loo_corr

    rows = scores[gt["indices"].long()].to(torch.float64)
    per_test, _ = loo_corr(rows, (gt["gt"], gt["indices"]))
    value = float(np.nanmean(per_test.numpy()))
    lo, hi = bootstrap_ci(per_test.numpy(), seed)
    return {"mean": value, "lo": lo, "hi": hi, "nan": int(np.isnan(per_test.numpy()).sum())}


def split_run_reliability(per_run: torch.Tensor, seed: int = 0) -> dict:
    """Spearman between run 0 and run 1 of the same subsets, per test sample, averaged.

    This is the ceiling an attribution method can reach against a *single* run; the
    ground truth averages ``R`` runs, whose reliability is higher (Spearman-Brown:
    ``R r / (1 + (R - 1) r)``, reported as ``mean_avg``).
    """
    if per_run.shape[1] < 2:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan")}
    per_test = spearman_columns(per_run[:, 0].numpy(), per_run[:, 1].numpy())
    r = float(np.nanmean(per_test))
    lo, hi = bootstrap_ci(per_test, seed)
    k = per_run.shape[1]
    return {
        "mean": r,
        "lo": lo,
        "hi": hi,
        "runs": k,
        "mean_avg": k * r / (1 + (k - 1) * r) if r > -1 / (k - 1) else float("nan"),
    }


def loo_corr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over test columns of the Pearson correlation across removed samples (rows)."""
    a = a - a.mean(0, keepdims=True)
    b = b - b.mean(0, keepdims=True)
    den = np.sqrt((a * a).sum(0) * (b * b).sum(0))
    ok = den > 0
    return float(((a * b).sum(0)[ok] / den[ok]).mean())
