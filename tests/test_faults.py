"""Fault tolerance through the real launch script on a loopback Ray head (real Ray Train + DeepSpeed ZeRO-2,
2 trainers, tiny random Qwen3-MoE target): a target worker and a trainer killed mid-run, and a SIGTERM then a
resume, each against an unfaulted run with the same seed; a failure a restart would only repeat is reported once;
one driver per run dir: a second one is refused, and the trainers of a SIGKILLed driver cannot commit into the run
of the driver that takes over at once; a disk that fills up during a save is one line, not retried.
The unfaulted reference is also the suite's one end-to-end training run on a MoE target: it must train, checkpoint
and export a draft that loads back onto the target's frozen weights.

Run: python -m pytest tests/test_faults.py -q     (about 3 minutes on 2 cores: the reference run and the killed
     workers; -m slow adds the SIGTERM, fatal-error, second-driver, killed-driver and full-disk tests, about 10
     minutes)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from launch_helpers import (
    LAUNCH,
    REPO,
    TINY_MOE,
    FaultSchedule,
    LoopbackHead,
    committed_checkpoints,
    console_errors,
    logged_steps,
    quiet_env,
    run_launch,
)
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
    assert not console_errors(out), console_errors(out)  # a healthy run prints nothing a person reads as a failure
    for r in read_jsonl_metrics(run_dir / "metrics.jsonl").values():  # phases summed over the 2 ranks
        phases = [r["forward_s"], r["backward_s"], r["optimizer_s"]]
        assert all(t > 0 for t in phases) and sum(phases) <= 2 * r["step_time_s"], r
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
    from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path

    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    draft = load_exported_draft(run_dir / "export", *embedding_weights(target))
    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as f:
        for k, v in draft.state_dict().items():
            assert torch.equal(f.get_tensor(k), v.float()), k


def pickled_modules(path: Path) -> set[str]:
    """The modules every pickle under `path` names (torch.save's zip archives and plain pickles alike)."""
    import io
    import pickletools
    import zipfile

    def modules(data: bytes) -> set[str]:
        found, strings = set(), []
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST"):
                found.add(arg.split(" ")[0])
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                found.add(strings[-2])
            elif isinstance(arg, str):
                strings.append(arg)
        return found

    names: set[str] = set()
    for f in path.rglob("*"):
        if not f.is_file():
            continue
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                for member in z.namelist():
                    if member.endswith(".pkl"):
                        names |= modules(z.read(member))
        elif f.suffix in (".pt", ".pkl", ".pickle"):
            names |= modules(f.read_bytes())
    return names


def test_checkpoints_name_no_module_of_this_project(clean):
    """A checkpoint resumes after a package is moved or renamed (workers/target -> workers/frozen_target): nothing
    in it is pickled by module path from this project, only torch's, DeepSpeed's and the standard library's."""
    names = pickled_modules(clean / "checkpoints" / f"step_{STEPS:08d}")
    assert names and "torch._utils" in names, names  # the scan reads the pickles it should
    ours = {n for n in names if n.split(".")[0] in ("draft_model", "pipeline", "workers", "serving", "evaluation")}
    assert not ours, ours


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
    # the group ended on the fatal error without a retry, and no rank printed a traceback
    assert out.count("Started training worker group") == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]


def _start(head: LoopbackHead, run_dir: Path, *extra: str, log_dir: Path | None = None,
           ) -> tuple[subprocess.Popen, Path]:
    """The launch script in the background on `run_dir`; its output goes to <log_dir, by default the run dir's
    parent>/<run dir's name>.<n>.log."""
    log_dir = log_dir or run_dir.parent
    log = log_dir / f"{run_dir.name}.{len(list(log_dir.glob(run_dir.name + '.*.log')))}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(LAUNCH), "--run-dir", str(run_dir), *COMMON, *extra], cwd=REPO,
                                env=quiet_env(RAY_ADDRESS=head.address), stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _wait_for(what: str, cond, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_second_driver_on_a_running_run_dir_exits_2_and_changes_nothing(head, tmp_path):
    run_dir = tmp_path / "owned"
    first, log = _start(head, run_dir, "--max-steps", "1000")  # still training when the second one is refused
    try:
        _wait_for("the first run's step 2", lambda: logged_steps(run_dir) >= 2 or first.poll() is not None)
        kept = {name: (run_dir / name).stat().st_mtime_ns for name in ("samples.parquet", "config.yaml", "lease.json")}
        del kept["lease.json"]  # renewed in place every 5 s; its owner is checked below
        t0 = time.time()
        second = run_launch(["--run-dir", str(run_dir), *COMMON], env=quiet_env(RAY_ADDRESS=head.address))
        took = time.time() - t0
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert re.fullmatch(rf"error: run dir {re.escape(str(run_dir))} is in use by pid {first.pid} on host \S+ "
                            r"\(job local\) since \S+Z \(lease renewed \d+ s ago; one not renewed for 30 s is taken "
                            r"over\)", lines[0]), lines[0]
        assert took < 60, took  # refused before any data, target or Ray work
        assert {name: (run_dir / name).stat().st_mtime_ns for name in kept} == kept
        assert first.poll() is None, log.read_text()[-4000:]
        first.send_signal(signal.SIGTERM)  # the first run goes on undisturbed, to its own stop
        assert first.wait(timeout=600) == 75, log.read_text()[-4000:]
    finally:
        first.kill()
    stopped = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert audit_checkpoint(stopped).exactly_once


@pytest.mark.slow
def test_the_trainers_of_a_killed_driver_cannot_commit_into_the_next_driver_s_run(head, tmp_path):
    """kill -9 of the driver while its trainers checkpoint every step, then a new driver at once: it takes the run
    dir over (the old pid is gone: no wait for the lease to expire), and from then on nothing more is committed
    until its own trainers start; it resumes from the last checkpoint the old run committed and finishes clean."""
    from workers.lease import LEASE_FILE, read_lease

    run_dir = tmp_path / "killed"
    first, first_log = _start(head, run_dir, "checkpoint.every_steps=1")  # a commit every step: orphans would try
    try:
        _wait_for("the first run's step 3", lambda: logged_steps(run_dir) >= 3 or first.poll() is not None)
        first.kill()
        first.wait()
    finally:
        first.kill()
    second, log = _start(head, run_dir)
    try:
        _wait_for("the takeover", lambda: (read_lease(run_dir / LEASE_FILE).generation == 2
                                           or second.poll() is not None), timeout=120)
        at_takeover = committed_checkpoints(run_dir)
        _wait_for("the new driver's trainers", lambda: "resumed from" in log.read_text() or second.poll() is not None)
        assert committed_checkpoints(run_dir) == at_takeover  # the old trainers committed nothing after the takeover
        text = log.read_text()
        assert f"took over run dir {run_dir} from pid {first.pid} on host " in text and \
            f"(its lease was pid {first.pid} is gone); lease generation 2" in text, text[-4000:]
        assert f"resumed from {run_dir / 'checkpoints' / at_takeover[0]}" in text, text[-4000:]
        assert second.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        second.kill()
    audit = audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert audit.exactly_once and audit.steps == STEPS, audit.line()


@pytest.mark.slow
def test_a_disk_that_fills_up_during_a_save_is_one_line_not_retried(head, tmp_path):
    """A real ENOSPC on a small tmpfs (needs root to mount it): filled after the step-4 checkpoint, the step-8 save
    fails; reported once, the partial dir removed, the step-4 checkpoint kept."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        run_dir = mnt / "run"
        proc, log = _start(head, run_dir, log_dir=tmp_path)  # the log off the disk that fills up
        try:
            _wait_for("step 5", lambda: logged_steps(run_dir) >= 5 or proc.poll() is not None)
            free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
            with open(mnt / "filler", "wb") as f:  # leave 256 KiB: the metrics rows fit, a checkpoint does not
                f.truncate(0)
                for _ in range((free - (256 << 10)) >> 20):
                    f.write(b"\0" * (1 << 20))
            assert proc.wait(timeout=600) == 1, log.read_text()[-4000:]
        finally:
            proc.kill()
        out = log.read_text()
        line = out.strip().splitlines()[-1]
        line = line[line.find("error: "):]  # a worker's unfinished log line may precede it on that line
        assert re.fullmatch(rf"error: training failed: StorageError: cannot save checkpoint step_00000008 under "
                            rf"{re.escape(str(run_dir))}/checkpoints: the disk is full \(ENOSPC\); the last "
                            r"checkpoint, step_00000004, needed [\d.]+ MiB, [\d.]+ MiB free now; removed the partial "
                            r"step_00000008.tmp; free space, then re-run the same command to resume from step_00000004",
                            line), out[-4000:]
        assert out.count("Started training worker group") == 1, out[-4000:]  # ended on the fatal error, no retry
        assert "Traceback" not in out, out[-4000:]
        assert committed_checkpoints(run_dir) == ("step_00000004", ["step_00000004"])
        assert not list((run_dir / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
