"""The headline arithmetic of a concurrency sweep (bench/sweep_summary.py, printed by bench/scheduling.py) on
hand-made sweep results with exact expected numbers: knee, best static, ratios at the knee, worst over the sweep,
the matched-throughput interpolation.

Run: python -m pytest tests/test_sweep_summary.py -q
"""

from __future__ import annotations

import math

import pytest
from sweep_summary import (
    best_static,
    headline,
    headline_line,
    knee,
    matched_per_user_ratio,
    per_user_at_throughput,
    ratio_at,
    worst_over_sweep,
)

from serving.simulator import SimResult

RS = [1, 2, 4, 8, 16]
# policy -> (aggregate tokens/s per R, per-user tokens/s per R)
SWEEP = {
    "γ=1": ([10, 19, 34, 50, 55], [10, 9.5, 8.5, 6.0, 3.4]),
    "γ=2": ([12, 22, 36, 48, 50], [12, 11, 9, 6.0, 3.1]),
    "alg1": ([12, 21, 38, 52, 56], [12, 10.5, 9.5, 6.5, 3.5]),
    "async": ([11, 21, 35, 49, 54], [11, 10.5, 8.75, 6.1, 3.4]),
    "mtp1": ([9, 17, 30, 44, 54], [9, 8.5, 7.5, 5.5, 3.25]),
}
STATICS = ["γ=1", "γ=2"]


def result(policy: str, R: int, tps: float, per_user: float) -> SimResult:
    return SimResult(policy=policy, concurrency=R, steps=1, time_s=1.0, tokens=int(tps), request_rounds=R,
                     finished_requests=0, tokens_per_s=float(tps), per_user_tokens_per_s=float(per_user),
                     mean_verify_len=1.0, mean_batch_tokens=float(R), tau=1.0)


@pytest.fixture
def results() -> list[SimResult]:
    return [result(p, R, t, u) for p, (tps, pu) in SWEEP.items() for R, t, u in zip(RS, tps, pu)]


def test_best_static_and_knee(results):
    assert [best_static(results, STATICS, R).policy for R in RS] == ["γ=2", "γ=2", "γ=2", "γ=1", "γ=1"]
    # best static's per-user speed: 12, 11, 9, 6.0, 3.4; half of 12 is first reached at R = 8 (6.0 <= 6)
    assert knee(results, STATICS) == (8, True)
    assert ratio_at(results, "alg1", STATICS, 8) == pytest.approx(52 / 50)
    assert ratio_at(results, "async", STATICS, 8) == pytest.approx(49 / 50)


def test_knee_not_reached_is_the_last_concurrency(results):
    slow = [r for r in results if r.concurrency <= 4]  # per-user 12, 11, 9: never half of 12
    assert knee(slow, STATICS) == (4, False)


def test_worst_over_sweep(results):
    # alg1 / best static per R: 12/12, 21/22, 38/36, 52/50, 56/55
    worst, at = worst_over_sweep(results, "alg1", STATICS)
    assert worst == pytest.approx(21 / 22) and at == 2


def test_per_user_at_throughput_interpolates_at_the_first_crossing():
    assert per_user_at_throughput([10, 20, 30], [10, 8, 4], 25) == pytest.approx(6.0)
    assert per_user_at_throughput([10, 20, 30], [10, 8, 4], 5) == 10.0  # below the first point: the first point
    assert per_user_at_throughput([10, 30, 20, 40], [10, 8, 6, 4], 25) == pytest.approx(8.5)  # not the later one
    with pytest.raises(ValueError, match="never reaches"):
        per_user_at_throughput([10, 20], [5, 4], 21)


def test_matched_throughput_ratio_and_headline(results):
    # X = min(max alg1 56, max mtp1 54) = 54; alg1 crosses 54 between 52 (6.5) and 56 (3.5): 5.0; mtp1 at 54: 3.25
    ratio, X = matched_per_user_ratio(results, "alg1", "mtp1")
    assert X == 54 and ratio == pytest.approx(5.0 / 3.25)
    h = headline(results, STATICS, "alg1", "async", "mtp1")
    assert h["knee"] == 8 and h["best_static"] == "γ=1" and h["worst_at"] == 2
    assert headline_line(h) == ("scheduling alg1/best_static@knee=1.040 async/best_static@knee=0.980 "
                                "worst_over_sweep=0.955 per_user dspark/mtp1@matched_throughput=1.538")
    assert math.isclose(h["matched_throughput"], 54)
