"""End to end through the real launch script: Ray target worker -> hidden states -> packer -> 2 DeepSpeed ZeRO-2
trainers (gloo) on a tiny random Qwen3-MoE target; resume after SIGKILL of the driver; one Ray/DeepSpeed trainer
and --single-process log the same loss curve; `ray job submit`.

Run: python -m pytest tests/test_pipeline_e2e.py -q     (about 70 s on 2 cores: the training run; -m slow adds the
     resume, the trainer comparison and the job submission, about 4 minutes)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import LAUNCH, RAY_CLI, REPO, TINY_MOE, LoopbackHead, quiet_env, run_launch
from safetensors import safe_open

from pipeline.metrics import read_jsonl_metrics


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def test_tiny_moe_target_trains_and_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    res = run_launch(["--run-dir", str(run_dir), "--max-steps", "24", *TINY_MOE, "checkpoint.every_steps=12",
                      "train.lr=3e-3"])
    assert res.returncode == 0, res.stderr[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 25))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(20, 25)) / 5
    assert last < 0.9 * first, (first, last)
    # one dense log line per step, from rank 0
    assert "step 24/24 | loss" in res.stdout + res.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000024"
    meta = json.loads((ckpts / "step_00000024" / "meta.json").read_text())
    assert meta["step"] == 24 and meta["data_position"]["next_batch_index"] == 48
    assert meta["config"]["train"]["zero_stage"] == 2 and meta["config"]["cluster"]["num_trainers"] == 2
    assert (ckpts / "step_00000012").is_dir()
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


@pytest.fixture(scope="module")
def head():
    h = LoopbackHead(num_cpus=4, dashboard=True)
    yield h
    h.stop()


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path, head):
    n = 5
    common = [*TINY_MOE, f"checkpoint.every_steps={n}", "checkpoint.export=false"]
    env = quiet_env(RAY_ADDRESS=head.address)
    straight = tmp_path / "straight"
    res = run_launch(["--run-dir", str(straight), "--max-steps", str(2 * n), *common], env=env)
    assert res.returncode == 0, res.stderr[-4000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(LAUNCH), "--run-dir", str(killed), "--max-steps", str(2 * n),
                             *common], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == f"step_{n:08d}":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.read_text().strip() == f"step_{n:08d}"

    res = run_launch(["--run-dir", str(killed), "--max-steps", str(2 * n), *common], env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resuming from {killed / 'checkpoints' / f'step_{n:08d}'}" in res.stdout + res.stderr
    a, b = _losses(straight), _losses(killed)
    for step in range(n + 1, 2 * n + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a[step], b[step])
    assert (killed / "checkpoints" / "latest").read_text().strip() == f"step_{2 * n:08d}"


@pytest.mark.slow
def test_ray_and_single_process_trainers_log_the_same_losses(tmp_path, head):
    """The shared loop (workers/trainer/loop.py) under its two deployments, 1 trainer rank, same config and data:
    Ray FeatureService + DeepSpeed ZeRO-2 vs in-process TargetWorker + TorchEngine. Equal to 1e-5 relative: fp32
    draft, the same bf16-rounded features, the same batches; only DeepSpeed's and torch's AdamW/clipping kernels
    differ in summation order."""
    common = ["--max-steps", "8", *TINY_MOE, "cluster.num_trainers=1", "checkpoint.every_steps=4",
              "train.lr=3e-3", "checkpoint.export=false"]
    ray_dir, single_dir = tmp_path / "ray", tmp_path / "single"
    res = run_launch(["--run-dir", str(ray_dir), *common], env=quiet_env(RAY_ADDRESS=head.address))
    assert res.returncode == 0, res.stderr[-4000:]
    res = run_launch(["--run-dir", str(single_dir), "--single-process", *common])
    assert res.returncode == 0, res.stderr[-4000:]
    a, b = _losses(ray_dir), _losses(single_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), (step, a[step], b[step])
    assert a[8] < a[1]
    for d in (ray_dir, single_dir):  # the same checkpoint layout from both
        meta = json.loads((d / "checkpoints" / "step_00000008" / "meta.json").read_text())
        assert meta["data_position"]["next_batch_index"] == 8 and meta["config"]["cluster"]["num_trainers"] == 1


@pytest.mark.slow
def test_ray_job_submit(tmp_path, head):
    run_dir = tmp_path / "job"
    env = quiet_env()
    cmd = [*RAY_CLI, "job", "submit", f"--address=http://127.0.0.1:{head.dashboard_port}", f"--working-dir={REPO}",
           "--", sys.executable, "launch/train_v4_draft.py", "--run-dir", str(run_dir), "--max-steps", "3", *TINY_MOE,
           "checkpoint.every_steps=3"]
    deadline = time.time() + 180
    while True:  # the head's job agent comes up some seconds after its dashboard port opens
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        if res.returncode == 0 or "No available agent" not in out or time.time() > deadline:
            break
        time.sleep(3)
    assert res.returncode == 0, out[-4000:]
    assert "succeeded" in out.lower()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"
