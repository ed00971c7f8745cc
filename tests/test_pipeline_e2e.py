"""End to end through the real launch script on a tiny random Qwen3-MoE target (Ray target worker -> hidden states
-> packer -> DeepSpeed ZeRO-2 trainers, gloo): resume after SIGKILL of the driver; one Ray/DeepSpeed trainer and
--single-process log the same loss curve; `ray job submit`. All second-tier, so all slow: the default suite's one
MoE training run is the unfaulted reference of tests/test_faults.py, which checks what this file's plain run did.

Run: python -m pytest tests/test_pipeline_e2e.py -m slow -q     (about 4 minutes on 2 cores)
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
from launch_helpers import LAUNCH, RAY_CLI, REPO, TINY_MOE, LoopbackHead, quiet_env, run_launch

from pipeline.metrics import read_jsonl_metrics


def _losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


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


@pytest.mark.slow
def test_the_default_run_s_console_is_clean(tmp_path):
    """The README's second command (the embedded default: SmolLM2, real text, a local Ray started by the script),
    cut to 2 steps: it succeeds and prints no error-level line and no traceback (Ray Train's PreemptionWatcher and
    autoscaling coordinator are settled first: workers/run_control.prepare_ray_train). Run with no other Ray
    instance on the machine: Ray Train's placement-group cleaner looks the cluster up without an address and prints
    a traceback when it finds several."""
    from launch_helpers import SILENCED, console_errors, console_lines, repeated_lines

    env = {k: v for k, v in quiet_env().items() if k not in ("RAY_DEDUP_LOGS", "RAY_AUTH_MODE", "TQDM_DISABLE")}
    res = run_launch(["--run-dir", str(tmp_path / "run"), "--max-steps", "2"], timeout=1200, env=env)  # a user's env
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "step 2/2 | loss" in out
    assert not console_errors(out), console_errors(out)
    # issue #47: the step lines and at most about 25 others, none repeated, none of the silenced third-party messages
    steps, others = console_lines(out)
    assert len(steps) == 2 and len(others) <= 25, (len(others), others)
    assert not repeated_lines(others), repeated_lines(others)
    assert not [ln for ln in others if any(m in ln for m in SILENCED)]


def test_console_lines_are_counted_as_a_person_reads_them():
    from launch_helpers import console_lines, repeated_lines

    out = ("Loading weights:   0%|  | 0/2\rLoading weights: 100%|##| 2/2\n\n"
           "\x1b[36m(RayTrainWorker pid=7)\x1b[0m 10:00:01 [rank 0] INFO dspark.trainer: step 1/2 | loss 2.1\n"
           "(RayTrainWorker pid=7) warn once\x1b[32m [repeated 2x across cluster]\x1b[0m\n"
           "(RayTrainWorker pid=8) warn once\n(RayTrainWorker pid=8) \n"
           "10:00:02 [rank 0] INFO dspark.trainer: step 2/2 | loss 2.0 | lr 1e-3\n")
    steps, others = console_lines(out)
    assert [s.split("step ")[1][:3] for s in steps] == ["1/2", "2/2"]
    assert others == ["Loading weights:   0%|  | 0/2", "Loading weights: 100%|##| 2/2",
                      "(RayTrainWorker pid=7) warn once", "(RayTrainWorker pid=8) warn once"]
    assert repeated_lines(others) == {"warn once": 2}
