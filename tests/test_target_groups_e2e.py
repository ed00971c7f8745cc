"""Target groups end to end through the real launch script on a loopback Ray head (Ray + DeepSpeed ZeRO-2, one
trainer, gloo): a TP = 2 group of a tiny random DeepSeek-V3 target trains the draft to the same losses as one
unsharded target worker; a TP = 2 + EP = 2 group of a tiny Qwen3-MoE target with one member SIGKILLed mid-run
comes back whole and the run ends with the unsharded run's losses; bad group shapes fail with one line.

Features travel in fp32 here (target.wire_dtype=float32): sharded and unsharded features differ by ~1e-6, which
bf16 rounding would sometimes turn into one bf16 step (4e-3 relative) and so into a loss gap larger than 1e-5.

Run: python -m pytest tests/test_target_groups_e2e.py -q     (about 6 minutes on 2 cores)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import TINY_MOE, FaultSchedule, LoopbackHead, quiet_env, run_launch

from pipeline.metrics import read_jsonl_metrics

pytestmark = pytest.mark.slow
STEPS = 8
COMMON = ["--max-steps", str(STEPS), *TINY_MOE, "cluster.num_trainers=1", "target.wire_dtype=float32",
          "checkpoint.every_steps=4", "checkpoint.export=false", "train.lr=3e-3"]


@pytest.fixture(scope="module")
def head():
    h = LoopbackHead(num_cpus=4, dashboard=True)  # a group of 2 + 1 trainer
    yield h
    h.stop()


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def _run(head: LoopbackHead, run_dir: Path, *overrides: str) -> dict[int, float]:
    res = run_launch(["--run-dir", str(run_dir), *COMMON, *overrides], env=quiet_env(RAY_ADDRESS=head.address))
    assert res.returncode == 0, res.stderr[-4000:]
    return _losses(run_dir)


def _assert_same(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got[s], want[s])
    assert want[STEPS] < want[1]


def test_tp2_group_trains_to_the_unsharded_losses_deepseek_v3(head, tmp_path):
    want = _run(head, tmp_path / "tp1", "target.path=tiny-deepseek-v3")
    got = _run(head, tmp_path / "tp2", "target.path=tiny-deepseek-v3", "target.tp_size=2")
    _assert_same(got, want)


def test_killed_member_the_group_comes_back_and_the_losses_hold(head, tmp_path):
    want = _run(head, tmp_path / "tp1")
    run_dir = tmp_path / "ep2"
    # one batch prefetched at most, so the group still has batches to make after the kill
    args = ["--run-dir", str(run_dir), *COMMON, "target.tp_size=2", "target.expert_parallel=true",
            "data.max_in_flight=1"]
    rc, fired, log = FaultSchedule(head, args, run_dir, [(2, "kill", "TargetGroupMember")]).run()
    assert rc == 0, log[-4000:]
    assert [f[:3] for f in fired] == [(2, "kill", "TargetGroupMember")]
    assert "lost a member: restarting all 2 members" in log
    _assert_same(_losses(run_dir), want)


@pytest.mark.parametrize("overrides, line", [
    (["target.tp_size=4"], "error: target.tp_size=4 does not divide the target's num_key_value_heads (2): the "
                           "qwen3_moe plan splits its key/value heads evenly over the group; use a tp_size that "
                           "divides 2"),
    (["target.tp_size=2", "target.gpus_per_worker=1"], "error: the run needs 2 GPUs (target.num_workers=1 x "
                                                       "target.tp_size=2 x target.gpus_per_worker=1, plus 0 for 1 "
                                                       "trainer(s)) but the Ray cluster has 0"),
])
def test_bad_group_shapes_fail_with_one_line(head, tmp_path, overrides, line):
    res = run_launch(["--run-dir", str(tmp_path / "bad"), *COMMON, *overrides],
                     env=quiet_env(RAY_ADDRESS=head.address))
    assert res.returncode == 2, res.stderr[-4000:]
    assert res.stderr.strip().splitlines()[-1] == line
