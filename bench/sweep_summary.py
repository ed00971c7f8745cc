"""The headline numbers of a concurrency sweep (serving.simulator.sweep results), defined once, tested on hand-made
sweeps (tests/test_sweep_summary.py) and printed by bench/scheduling.py.

Definitions (all over the concurrencies R of the sweep; "static" = the given static-γ policies of one drafter):
- best_static(R): the static γ with the highest aggregate tokens/s at R (ties: the first listed).
- knee: the smallest swept R at which the per-user tokens/s of best_static(R) has fallen to half (or less) of
  its value at the smallest swept R; the largest swept R when it never does (`knee_reached` says which).
  Half-speed, not maximum curvature: on a sparse power-of-two grid (8-10 points) a discrete curvature is
  dominated by simulation noise and by the grid itself, while "each user got twice as slow" is a single robust
  crossing and is where batching stops being nearly free (the engine has left the flat part of SPS(B)).
- ratio_at(policy, R) = tokens/s of `policy` at R / tokens/s of best_static(R); X@knee is ratio_at(X, knee).
- worst_over_sweep(policy) = min over R of ratio_at(policy, R).
- matched throughput of policies a and b: X = the highest aggregate tokens/s both curves reach
  (min of the two maxima). Along each curve (points in order of R, linear interpolation between neighbours) the
  per-user tokens/s at aggregate X is read at the FIRST crossing (the smallest R that reaches X: the best
  per-user speed at that throughput); a curve whose first point is already above X reads its first point.
  per_user a/b@matched_throughput = per-user(a, X) / per-user(b, X).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.simulator import SimResult

__all__ = ["best_static", "curve", "headline", "headline_line", "knee", "matched_per_user_ratio",
           "per_user_at_throughput", "ratio_at", "worst_over_sweep"]


def curve(results: Sequence[SimResult], policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R_N, tokens_per_s_N, per_user_N) of one policy, in increasing R."""
    rs = sorted((r for r in results if r.policy == policy), key=lambda r: r.concurrency)
    if not rs:
        raise ValueError(f"no results for policy {policy!r}; have {sorted({r.policy for r in results})}")
    return (np.array([r.concurrency for r in rs]), np.array([r.tokens_per_s for r in rs]),
            np.array([r.per_user_tokens_per_s for r in rs]))


def _at(results: Sequence[SimResult], policy: str, R: int) -> SimResult:
    for r in results:
        if r.policy == policy and r.concurrency == R:
            return r
    raise ValueError(f"no result for policy {policy!r} at concurrency {R}")


def best_static(results: Sequence[SimResult], statics: Sequence[str], R: int) -> SimResult:
    """The static policy with the highest aggregate tokens/s at concurrency R (ties: the first in `statics`)."""
    cands = [_at(results, s, R) for s in statics]
    return cands[int(np.argmax([c.tokens_per_s for c in cands]))]


def knee(results: Sequence[SimResult], statics: Sequence[str]) -> tuple[int, bool]:
    """(knee R, whether the half-speed point was reached within the sweep); see the module docstring."""
    Rs = sorted({r.concurrency for r in results if r.policy == statics[0]})
    pu = [best_static(results, statics, R).per_user_tokens_per_s for R in Rs]
    for R, p in zip(Rs, pu):
        if p <= 0.5 * pu[0]:
            return R, True
    return Rs[-1], False


def ratio_at(results: Sequence[SimResult], policy: str, statics: Sequence[str], R: int) -> float:
    return _at(results, policy, R).tokens_per_s / best_static(results, statics, R).tokens_per_s


def worst_over_sweep(results: Sequence[SimResult], policy: str, statics: Sequence[str]) -> tuple[float, int]:
    """(min over R of ratio_at(policy, R), the R where it occurs)."""
    Rs, _, _ = curve(results, policy)
    ratios = [ratio_at(results, policy, statics, int(R)) for R in Rs]
    i = int(np.argmin(ratios))
    return ratios[i], int(Rs[i])


def per_user_at_throughput(tps_N: np.ndarray, pu_N: np.ndarray, X: float) -> float:
    """Per-user tokens/s where the curve (points in order of R) first reaches aggregate tokens/s X."""
    tps_N, pu_N = np.asarray(tps_N, dtype=float), np.asarray(pu_N, dtype=float)
    hit = np.flatnonzero(tps_N >= X)
    if hit.size == 0:
        raise ValueError(f"the curve never reaches {X} tokens/s (max {tps_N.max()})")
    i = int(hit[0])
    if i == 0:
        return float(pu_N[0])
    w = (X - tps_N[i - 1]) / (tps_N[i] - tps_N[i - 1])  # tps_N[i-1] < X <= tps_N[i]
    return float(pu_N[i - 1] + w * (pu_N[i] - pu_N[i - 1]))


def matched_per_user_ratio(results: Sequence[SimResult], a: str, b: str) -> tuple[float, float]:
    """(per-user(a, X) / per-user(b, X), X) at X = the highest aggregate tokens/s both a and b reach."""
    _, tps_a, pu_a = curve(results, a)
    _, tps_b, pu_b = curve(results, b)
    X = float(min(tps_a.max(), tps_b.max()))
    return per_user_at_throughput(tps_a, pu_a, X) / per_user_at_throughput(tps_b, pu_b, X), X


def headline(results: Sequence[SimResult], statics: Sequence[str], alg1: str, async_: str, mtp1: str) -> dict:
    """Every number of bench/scheduling.py's last line, with what they were measured at."""
    R_knee, reached = knee(results, statics)
    worst, R_worst = worst_over_sweep(results, alg1, statics)
    ratio, X = matched_per_user_ratio(results, alg1, mtp1)
    return {"knee": R_knee, "knee_reached": reached, "best_static": best_static(results, statics, R_knee).policy,
            "alg1_over_best_static": ratio_at(results, alg1, statics, R_knee),
            "async_over_best_static": ratio_at(results, async_, statics, R_knee),
            "worst_over_sweep": worst, "worst_at": R_worst, "per_user_alg1_over_mtp1": ratio,
            "matched_throughput": X}


def headline_line(h: dict) -> str:
    return (f"scheduling alg1/best_static@knee={h['alg1_over_best_static']:.3f} "
            f"async/best_static@knee={h['async_over_best_static']:.3f} worst_over_sweep={h['worst_over_sweep']:.3f} "
            f"per_user dspark/mtp1@matched_throughput={h['per_user_alg1_over_mtp1']:.3f}")
