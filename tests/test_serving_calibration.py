"""Tests of sequential temperature scaling and calibration.json (serving/calibration.py).

The synthetic rounds have known conditional acceptance probabilities c_k = σ(z_k); the outcomes are drawn from
them left to right; the "reported" logits are 3·z, i.e. over-confident by a temperature of exactly 3.

Run: python -m pytest tests/test_serving_calibration.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.calibration import (
    apply_sts,
    calibration_report,
    fit_single_temperature,
    fit_sts,
    load_calibration,
    plot_reliability,
    save_calibration,
    sigmoid,
    survival,
)
from serving.metrics import expected_calibration_error

N, K, OVERCONFIDENCE = 50_000, 4, 3.0
GRID = np.geomspace(0.5, 8.0, 121)  # 2.3 % steps: enough for the single-temperature tests, 3x faster


def synthetic_rounds(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(reported logits [N, K], num_accepted [N], true conditional probabilities [N, K])."""
    rng = np.random.default_rng(seed)
    z_NK = rng.normal(1.0, 1.5, size=(N, K))  # true logits: acceptance varies a lot from round to round
    c_NK = sigmoid(z_NK)
    accepted_NK = rng.random((N, K)) < c_NK
    num_accepted_N = np.cumprod(accepted_NK, axis=1).sum(1)  # leading accepted tokens
    return z_NK * OVERCONFIDENCE, num_accepted_N, c_NK


@pytest.fixture(scope="module")
def fitted():
    logit_NK, n_N, c_NK = synthetic_rounds()
    return logit_NK, n_N, c_NK, fit_sts(logit_NK, n_N)


def test_sts_recovers_the_overconfidence_temperature(fitted):
    _, _, _, t_K = fitted
    # the generating temperature is 3 at every position; the grid step is ~1.5 %
    np.testing.assert_allclose(t_K, OVERCONFIDENCE, rtol=0.1)


def test_sts_calibrates_the_cumulative_survival(fitted):
    logit_NK, n_N, c_NK, t_K = fitted
    rep = calibration_report(logit_NK, n_N, t_K)
    assert rep["num_rounds"] == N and rep["temperatures"] == t_K.tolist()
    for k in range(K):
        assert rep["ece_after"][k] < 0.015, (k, rep["ece_after"])
        assert rep["ece_after"][k] < rep["ece_before"][k] / 3, (k, rep["ece_before"], rep["ece_after"])
    # the report's ECE is serving.metrics' ECE of the cumulative product against n >= k
    a_NK = survival(apply_sts(logit_NK, t_K))
    assert rep["ece_after"][2] == expected_calibration_error(a_NK[:, 2], n_N >= 3)
    # the observed survival is the generating process's E[Π_{i≤k} c_i] (the synthetic data are what they claim)
    np.testing.assert_allclose(rep["observed_survival"], survival(c_NK).mean(0), atol=0.01)


def test_sts_preserves_order_per_position(fitted):
    logit_NK, n_N, _, t_K = fitted
    cal_NK = apply_sts(logit_NK, t_K)
    for k in range(K):  # a positive temperature is monotone: the same ranking of rounds at every position
        np.testing.assert_array_equal(np.argsort(cal_NK[:, k], kind="stable"),
                                      np.argsort(logit_NK[:, k], kind="stable"))
    rep = calibration_report(logit_NK, n_N, t_K)
    assert rep["roc_auc_after"][0] == rep["roc_auc_before"][0]  # k = 1: the survival is c_1 itself
    assert 0.6 < rep["roc_auc_after"][0] < 1.0


def test_well_calibrated_logits_keep_temperature_one():
    logit_NK, n_N, _ = synthetic_rounds(seed=1)
    t_K = fit_sts(logit_NK / OVERCONFIDENCE, n_N)  # the true logits
    np.testing.assert_allclose(t_K, 1.0, rtol=0.1)


def test_apply_sts_and_survival_values():
    logit_K = np.array([0.0, np.log(3.0), 2 * np.log(4.0)])
    c_K = apply_sts(logit_K, [1.0, 1.0, 2.0])
    np.testing.assert_allclose(c_K, [0.5, 0.75, 0.8])
    np.testing.assert_allclose(survival(c_K), [0.5, 0.375, 0.3])
    assert apply_sts(np.zeros((2, 5, 3)), [1, 2, 3]).shape == (2, 5, 3)  # leading axes broadcast


@pytest.mark.parametrize("temps, match", [([1.0, 0.0, 1.0], "positive"), ([1.0, 2.0], "2 temperatures for 3")])
def test_bad_temperatures(temps, match):
    with pytest.raises(ValueError, match=match):
        apply_sts(np.zeros((4, 3)), temps)


def test_bad_records():
    with pytest.raises(ValueError, match="one entry per round"):
        fit_sts(np.zeros((4, 3)), np.zeros(5))
    with pytest.raises(ValueError, match="integers in 0..K=3"):
        fit_sts(np.zeros((4, 3)), np.array([0, 1, 4, 2]))


def test_one_temperature_for_every_position_recovers_a_shared_overconfidence(fitted):
    """The synthetic logits are over-confident by the same 3 at every position: the single fit finds it, and its
    held-out ECE (fitted on one draw, reported on another) is far below the raw one at every position and close
    to the per-position STS."""
    logit_NK, n_N, _, t_K = fitted
    t = fit_single_temperature(logit_NK, n_N, GRID)
    assert t == pytest.approx(OVERCONFIDENCE, rel=0.05)
    held_logit, held_n, _ = synthetic_rounds(seed=1)
    rep = calibration_report(held_logit, held_n, t_K, single_temperature=t)
    assert rep["single_temperature"] == t
    for k in range(K):
        assert rep["ece_single"][k] < 0.25 * rep["ece_before"][k]
        assert rep["ece_single"][k] < rep["ece_after"][k] + 0.01
    # the "single" curve is the survival of σ(logit / t) at every position
    a_NK = survival(sigmoid(held_logit / t))
    assert rep["ece_single"][2] == expected_calibration_error(a_NK[:, 2], held_n >= 3)


def test_single_temperature_differs_from_sts_where_positions_differ():
    """Over-confident by 1 at position 1 and by 4 at the others: STS fits each; the one shared T lies between."""
    logit_NK, n_N, _ = synthetic_rounds(seed=2)
    logit_NK = logit_NK / OVERCONFIDENCE * np.array([1.0, 4.0, 4.0, 4.0])
    t_K = fit_sts(logit_NK, n_N, GRID)
    np.testing.assert_allclose(t_K, [1.0, 4.0, 4.0, 4.0], rtol=0.12)
    t = fit_single_temperature(logit_NK, n_N, GRID)
    assert 1.2 < t < 4.0
    rep = calibration_report(logit_NK, n_N, t_K, single_temperature=t)
    assert np.mean(rep["ece_after"]) < np.mean(rep["ece_single"]) < np.mean(rep["ece_before"])


def test_calibration_json_round_trip(tmp_path):
    path = tmp_path / "draft" / "calibration.json"
    meta = {"draft": "dspark-tiny", "num_rounds": 123, "dataset": "held-out"}
    save_calibration(path, [2.5, 3.0, 3.25], meta)
    t_K, single, meta_back = load_calibration(path)
    assert single is None  # not fitted
    np.testing.assert_array_equal(t_K, [2.5, 3.0, 3.25])
    assert meta_back == meta
    assert [p.name for p in path.parent.iterdir()] == ["calibration.json"]  # no temp file left behind
    save_calibration(path, [2.5, 3.0, 3.25], meta, single_temperature=2.75)
    assert load_calibration(path).single_temperature == 2.75
    assert json.loads(path.read_text())["format"] == "dspark-sts/2"
    # a dspark-sts/1 file (no single temperature) is still read
    path.write_text(json.dumps({"format": "dspark-sts/1", "temperatures": [2.0, 3.0], "meta": {}}))
    old = load_calibration(path)
    assert old.temperatures.tolist() == [2.0, 3.0] and old.single_temperature is None


@pytest.mark.parametrize("content, match", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"format": "dspark-sts/1", "temperatures": [1.0]}), "keys must be"),
    (json.dumps({"format": "other", "temperatures": [1.0], "meta": {}}), "format must be"),
    (json.dumps({"format": "dspark-sts/1", "temperatures": [1.0, -2.0], "meta": {}}), "positive numbers"),
    (json.dumps({"format": "dspark-sts/1", "temperatures": [], "meta": {}}), "positive numbers"),
    (json.dumps({"format": "dspark-sts/2", "temperatures": [1.0], "meta": {}}), "keys must be"),
    (json.dumps({"format": "dspark-sts/2", "temperatures": [1.0], "single_temperature": 0, "meta": {}}),
     "single_temperature must be a positive number or null"),
    (json.dumps({"format": "dspark-sts/1", "temperatures": [1.0], "single_temperature": 2.0, "meta": {}}),
     "keys must be"),
])
def test_malformed_calibration_file(tmp_path, content, match):
    path = tmp_path / "calibration.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as exc:
        load_calibration(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read calibration file"):
        load_calibration(tmp_path / "nope.json")


def test_reliability_plot(tmp_path):
    pytest.importorskip("matplotlib")
    logit_NK, n_N, _ = synthetic_rounds(seed=2)
    path = plot_reliability(logit_NK[:2000], n_N[:2000], [3.0] * K, tmp_path / "reliability.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
