"""launch/profile_sps.py on a tiny random target: one entry per B, positive rates, provenance, and a round trip
through serving.sps.SPSTable.from_json; the engine step (workers/frozen_target/engine_step.py) keeps the KV context
fixed;
bad input is one line: exit 2 from the CLI (run as a user runs it), a one-line ValueError from `profile`.

Run: python -m pytest tests/test_profile_sps_cli.py -q
"""

from __future__ import annotations

import json

import pytest
from launch_helpers import run_script

from serving.sps import REQUIRED_META, SPSTable
from workers.frozen_target.engine_step import EngineStep, profile
from workers.frozen_target.model import load_target, resolve_target_path


def test_profile_writes_a_table_with_one_entry_per_batch_size(tmp_path):
    """What the CLI does (launch/profile_sps.py: `profile`, then `to_json`), in this process."""
    out = tmp_path / "sps.json"
    profile("tiny-qwen3-moe", [2, 3, 8], 2, 16, 2, warmup=1).to_json(out)  # the CLI's default warmup
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


@pytest.mark.slow  # ~10 s: the same profile as a user runs it
def test_cli_prints_and_writes_the_table(tmp_path):
    out = tmp_path / "sps.json"
    res = run_script("profile_sps.py", ["--target", "tiny-qwen3-moe", "--batch-sizes", "2,3,8", "--requests", "2",
                                        "--context", "16", "--repeats", "2", "--out", str(out)])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "steps/s" in res.stdout and f"wrote {out}" in res.stdout
    assert SPSTable.from_json(out).batch_sizes.tolist() == [2, 3, 8]


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    out = str(tmp_path / "sps.json")
    for args in (["--batch-sizes", "4,2"], ["--batch-sizes", "a"]):  # the CLI's own parsing
        res = run_script("profile_sps.py", ["--target", "tiny-qwen3-moe", *args, "--out", out])
        assert res.returncode == 2
        err = res.stderr.strip()
        assert err.startswith("error: ") and "\n" not in err, err
    # what `profile` refuses, the CLI reports the same way (its one `except ValueError` above)
    base = {"target_name": "tiny-qwen3-moe", "batch_sizes": [1, 2, 4], "requests": 1, "context": 16, "repeats": 1,
            "warmup": 0}
    for bad in ({"batch_sizes": [1, 2], "requests": 2}, {"dtype_name": "nope"}, {"repeats": 0}):
        with pytest.raises(ValueError) as e:
            profile(**{**base, **bad})
        assert "\n" not in str(e.value), e.value
