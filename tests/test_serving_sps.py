"""Tests of the steps-per-second cost table (serving/sps.py): lookup, extrapolation, JSON, measurement.

Run: python -m pytest tests/test_serving_sps.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.sps import SPSTable, measure_sps

META = {"target": "toy", "dtype": "fp32", "hardware": "test", "date": "2026-01-01", "method": "by hand"}


def table() -> SPSTable:
    # step times 10, 10, 20, 40 ms at B = 1, 4, 8, 16
    return SPSTable([1, 4, 8, 16], [100.0, 100.0, 50.0, 25.0], META)


def test_step_function_rounds_up_to_the_next_measured_size():
    sps = table()
    assert [sps(b) for b in (1, 2, 4, 5, 8, 9, 16)] == [100.0, 100.0, 100.0, 50.0, 50.0, 25.0, 25.0]
    np.testing.assert_array_equal(sps(np.array([[3, 6], [12, 16]])), [[100.0, 50.0], [25.0, 25.0]])
    assert isinstance(sps(3), float)


def test_linear_tables_interpolate_the_step_time_between_measured_sizes():
    sps = SPSTable([1, 4, 8, 16], [100.0, 100.0, 50.0, 25.0], {**META, "interpolation": "linear"})
    # 20 ms at 8, 40 ms at 16: B = 9 costs 22.5 ms, not the 40 ms a step table charges
    assert sps.step_time(9) == pytest.approx(0.0225) and table().step_time(9) == pytest.approx(0.040)
    assert [sps.step_time(b) for b in (1, 4, 8, 16)] == [table().step_time(b) for b in (1, 4, 8, 16)]
    assert sps.step_time(20) == pytest.approx(0.050)  # the same extrapolation above the table
    with pytest.raises(ValueError, match="interpolation"):
        SPSTable([1, 2], [10.0, 5.0], {**META, "interpolation": "cubic"})


def test_step_time_extrapolates_linearly_above_the_last_size():
    sps = table()
    # slope from (8, 20 ms) to (16, 40 ms): 2.5 ms per token; B = 20 → 40 + 4·2.5 = 50 ms
    assert sps.step_time(20) == pytest.approx(0.050)
    assert sps(20) == pytest.approx(20.0)
    assert sps(32) == pytest.approx(1 / 0.080)
    # a measured time that falls at the end (noise) is extrapolated flat, never towards zero time
    noisy = SPSTable([1, 2], [10.0, 12.0])
    assert noisy(1000) == 12.0
    assert SPSTable([4], [7.0])(100) == 7.0  # one point: flat


@pytest.mark.parametrize("B", [0, -3, np.array([1, 0]), 2.5])
def test_bad_batch_size(B):
    with pytest.raises(ValueError, match="integer >= 1"):
        table()(B)


@pytest.mark.parametrize("sizes, sps, match", [
    ([1, 1], [1.0, 1.0], "strictly increasing"),
    ([0, 2], [1.0, 1.0], "strictly increasing"),
    ([1, 2], [1.0, 0.0], "positive"),
    ([1, 2], [1.0], "same length"),
])
def test_bad_table(sizes, sps, match):
    with pytest.raises(ValueError, match=match):
        SPSTable(sizes, sps)


def test_json_round_trip(tmp_path):
    path = table().to_json(tmp_path / "sps.json")
    back = SPSTable.from_json(path)
    np.testing.assert_array_equal(back.batch_sizes, [1, 4, 8, 16])
    np.testing.assert_array_equal(back.steps_per_s, [100.0, 100.0, 50.0, 25.0])
    assert back.meta == META
    assert back(20) == table()(20)


def test_json_needs_the_provenance(tmp_path):
    with pytest.raises(ValueError, match=r"missing \['dtype', 'hardware', 'date', 'method'\]"):
        SPSTable([1], [1.0], {"target": "toy"}).to_json(tmp_path / "sps.json")


def test_malformed_json(tmp_path):
    path = tmp_path / "sps.json"
    path.write_text(json.dumps({"batch_sizes": [2, 1], "steps_per_s": [1.0, 1.0], "meta": {}}))
    with pytest.raises(ValueError, match="malformed SPS table .*strictly increasing"):
        SPSTable.from_json(path)
    path.write_text(json.dumps({"batch_sizes": [1]}))
    with pytest.raises(ValueError, match="keys must be"):
        SPSTable.from_json(path)


def test_measure_sps_takes_the_median_after_warmup():
    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def step(B):  # a fake engine: 1 ms per token, plus a slow first (warm-up) call at every size
        calls.append(B)
        now[0] += 0.001 * B + (1.0 if calls.count(B) == 1 else 0.0)

    sps = measure_sps(step, [1, 2, 8], repeats=3, warmup=1, meta={"target": "fake"}, clock=clock)
    assert calls == [1] * 4 + [2] * 4 + [8] * 4
    np.testing.assert_allclose(sps.steps_per_s, [1000.0, 500.0, 125.0])
    assert sps.meta["target"] == "fake" and "median of 3" in sps.meta["method"]
    assert set(sps.meta) >= {"hardware", "date", "method"}
