"""Fault tolerance through the real launch script on a loopback Ray head (real Ray Train + DeepSpeed ZeRO-2,
2 trainers, tiny random Qwen3-MoE target): a target worker and a trainer killed mid-run, and a SIGTERM then a
resume, each against an unfaulted run with the same seed; a failure a restart would only repeat is reported once.
The unfaulted reference is also the suite's one end-to-end training run on a MoE target: it must train, checkpoint
and export a draft that loads back onto the target's frozen weights.

Run: python -m pytest tests/test_faults.py -q     (about 3 minutes on 2 cores: the reference run and the killed
     workers; -m slow adds the SIGTERM and the fatal-error tests, about 2 minutes)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from launch_helpers import TINY_MOE, FaultSchedule, LoopbackHead, quiet_env, run_launch
from safetensors import safe_open

from pipeline.metrics import read_jsonl_metrics
from workers.trainer.ledger import audit_checkpoint

STEPS = 12
COMMON = ["--max-steps", str(STEPS), *TINY_MOE, "checkpoint.every_steps=4", "train.lr=3e-3",
          "cluster.max_failures=2"]


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


@pytest.fixture(scope="module")
def head():
    h = LoopbackHead(num_cpus=4, dashboard=True)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def clean_run(head, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    res = run_launch(["--run-dir", str(run_dir), *COMMON], env=quiet_env(RAY_ADDRESS=head.address))
    assert res.returncode == 0, res.stderr[-4000:]
    return run_dir, res.stdout + res.stderr


@pytest.fixture(scope="module")
def clean(clean_run):
    return clean_run[0]


def test_tiny_moe_target_trains_checkpoints_and_exports(clean_run):
    run_dir, out = clean_run
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(STEPS - 4, STEPS + 1)) / 5
    assert last < 0.9 * first, (first, last)
    assert f"step {STEPS}/{STEPS} | loss" in out  # one dense log line per step, from rank 0
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{STEPS:08d}"
    meta = json.loads((ckpts / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["data_position"]["next_batch_index"] == 2 * STEPS
    assert meta["config"]["train"]["zero_stage"] == 2 and meta["config"]["cluster"]["num_trainers"] == 2
    assert (ckpts / f"step_{STEPS - 4:08d}").is_dir()
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not any("frozen" in k for k in keys), keys  # the target's embedding/LM head are not exported
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["draft"]["hidden_size"] == 64 and cfg["draft"]["vocab_size"] == 49152
    # the export loads back onto the target's frozen embedding/LM head, weight for weight
    from pipeline.export import load_exported_draft
    from workers.target.model import embedding_weights, load_target, resolve_target_path

    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    draft = load_exported_draft(run_dir / "export", *embedding_weights(target))
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        for k, v in draft.state_dict().items():
            assert torch.equal(f.get_tensor(k), v.float()), k


def _assert_same_curve(run_dir: Path, clean: Path, steps: range) -> None:
    got, want = _losses(run_dir), _losses(clean)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in steps:
        assert got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-7), (s, got[s], want[s])


def test_killed_target_worker_and_trainer_the_run_finishes_exactly_once(head, clean, tmp_path):
    run_dir = tmp_path / "faulty"
    # step 2: a target worker crashes (Ray restarts it, its batches are re-run); step 6: a trainer crashes (Ray
    # Train restarts the group, which resumes from the step-4 checkpoint)
    rc, fired, log = FaultSchedule(head, ["--run-dir", str(run_dir), *COMMON], run_dir,
                                   [(2, "kill", "TargetWorker"), (6, "kill", "RayTrainWorker")]).run()
    assert rc == 0, log[-4000:]
    assert [f[:3] for f in fired] == [(2, "kill", "TargetWorker"), (6, "kill", "RayTrainWorker")]
    assert "resumed from" in log and "step_00000004" in log  # the restarted group found its checkpoint itself
    _assert_same_curve(run_dir, clean, range(1, STEPS + 1))
    audit = audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert audit.exactly_once and audit.steps == STEPS and audit.batches == 2 * STEPS, audit.line()
    assert audit.samples_trained == 2 * STEPS * 4


@pytest.mark.slow
def test_sigterm_checkpoints_at_the_next_step_and_resume_continues_the_curve(head, clean, tmp_path):
    run_dir = tmp_path / "preempted"
    rc, fired, log = FaultSchedule(head, ["--run-dir", str(run_dir), *COMMON], run_dir, [(5, "sigterm", None)]).run()
    assert rc == 75, log[-4000:]
    assert "stopped: stopped on request at step" in log
    stopped_at = int(log.split("stopped on request at step ")[1].split()[0])
    assert 5 <= stopped_at < STEPS
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"
    assert audit_checkpoint(run_dir / "checkpoints" / f"step_{stopped_at:08d}").exactly_once
    res = run_launch(["--run-dir", str(run_dir), *COMMON], env=quiet_env(RAY_ADDRESS=head.address))
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in res.stdout + res.stderr
    _assert_same_curve(run_dir, clean, range(1, STEPS + 1))
    assert audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}").exactly_once


@pytest.mark.slow
def test_a_failure_a_restart_would_repeat_is_reported_once_not_retried(head, tmp_path):
    run_dir = tmp_path / "fatal"
    # a batch timeout no target can meet: deterministic, so restarting the trainer group would only repeat it
    res = run_launch(["--run-dir", str(run_dir), *COMMON, "target.batch_timeout_s=0.001"],
                     env=quiet_env(RAY_ADDRESS=head.address))
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]
    assert re.search(r"error: training failed: .*TimeoutError: feature batch \d+ not ready after", res.stderr)
    # the first attempt failed; the one retry Ray Train made returned at once; no third
    assert out.count("Started training worker group") == 2, out[-4000:]
