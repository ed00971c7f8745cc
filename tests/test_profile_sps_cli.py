"""launch/profile_sps.py on a tiny random target: one entry per B, positive rates, provenance, and a round trip
through serving.sps.SPSTable.from_json; the engine step keeps the KV context fixed; bad input is exit 2.

Run: python -m pytest tests/test_profile_sps_cli.py -q
"""

from __future__ import annotations

import json

import pytest

from launch import profile_sps
from serving.sps import REQUIRED_META, SPSTable
from workers.target.engine_step import EngineStep
from workers.target.model import load_target, resolve_target_path


def test_profile_writes_a_table_with_one_entry_per_batch_size(tmp_path, capsys):
    out = tmp_path / "sps.json"
    assert profile_sps.main(["--target", "tiny-qwen3-moe", "--batch-sizes", "2,3,8", "--requests", "2",
                             "--context", "16", "--repeats", "2", "--out", str(out)]) == 0
    assert "steps/s" in capsys.readouterr().out
    table = SPSTable.from_json(out)
    assert table.batch_sizes.tolist() == [2, 3, 8] and all(s > 0 for s in table.steps_per_s)
    assert all(k in table.meta for k in REQUIRED_META)
    assert table.meta["target"] == "tiny-qwen3-moe" and table.meta["dtype"] == "float32"
    assert table.meta["requests"] == 2 and table.meta["context"] == 16 and "R*ceil(B/R)" in table.meta["method"]
    assert table.interpolation == "linear"  # a plain forward pads to no bucket
    assert json.loads(out.read_text())["batch_sizes"] == [2, 3, 8]
    t3, t8 = 1 / table.steps_per_s[1], 1 / table.steps_per_s[2]  # inside the table: linear in the step time
    assert table.step_time(5) == pytest.approx(t3 + (t8 - t3) * 2 / 5)


def test_engine_step_keeps_the_context_and_runs_rectangular_batches():
    model, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    step = EngineStep(model, requests=3, context=10)
    for B in (3, 4, 9):
        step(B)
        assert step.cache.get_seq_length() == 10
    assert step.cache.layers[0].keys.shape[0] == 3  # one cache row per request


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    out = str(tmp_path / "sps.json")
    for args in (["--batch-sizes", "4,2"], ["--batch-sizes", "1,2", "--requests", "2"], ["--batch-sizes", "a"],
                 ["--dtype", "nope"], ["--repeats", "0"]):
        assert profile_sps.main(["--target", "tiny-qwen3-moe", *args, "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
