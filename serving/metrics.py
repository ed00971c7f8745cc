"""Calibration metrics of the drafter's confidences: ECE and ROC-AUC. NumPy only (serving/calibration.py fits with
them; evaluation/ reports them)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["expected_calibration_error", "roc_auc"]


def expected_calibration_error(confidence: Sequence[float] | np.ndarray, outcome: Sequence[float] | np.ndarray,
                               num_bins: int = 10) -> float:
    """ECE with `num_bins` equal-width bins on [0, 1]: Σ_b (n_b / n) |mean confidence_b − mean outcome_b|.

    `outcome` is 1 where the event happened (the token was accepted), else 0. NaN for empty input.
    """
    c = np.asarray(confidence, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    if c.shape != y.shape:
        raise ValueError(f"confidence ({c.shape[0]}) and outcome ({y.shape[0]}) must have the same length")
    if c.size == 0:
        return math.nan
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    # bin b holds [b/n, (b+1)/n); confidence 1.0 goes into the last bin
    bins = np.clip((c * num_bins).astype(np.int64), 0, num_bins - 1)
    conf_sum = np.bincount(bins, weights=c, minlength=num_bins)
    out_sum = np.bincount(bins, weights=y, minlength=num_bins)
    return float(np.abs(conf_sum - out_sum).sum() / c.size)  # Σ_b n_b/n |conf_b/n_b − out_b/n_b|


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # start index of each run of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]
    mean_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def roc_auc(score: Sequence[float] | np.ndarray, label: Sequence[float] | np.ndarray) -> float:
    """Area under the ROC curve by the rank (Mann-Whitney U) formula, ties counted one half.

    AUC = (Σ ranks of positives − n⁺(n⁺+1)/2) / (n⁺ n⁻): the probability that a random positive scores above a
    random negative. NaN when either class is absent (the AUC is undefined then).
    """
    s = np.asarray(score, dtype=np.float64).ravel()
    y = np.asarray(label).ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"score ({s.shape[0]}) and label ({y.shape[0]}) must have the same length")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = _average_ranks(s)[y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
