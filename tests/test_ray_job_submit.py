"""`ray job submit` as users run it, against a simulated multi-node Ray cluster (bench/node_loss.rehearsal_cluster: a
head with no CPUs, two trainer nodes, two target nodes, on loopback): `ray job submit --address … --working-dir … --
python launch/train_v4_draft.py …`, the job finishing, its logs read back with `ray job logs`, its status with
`ray job status`, and the run's ledger exactly once. The job runs the uploaded working dir (Ray puts it on the job's
PYTHONPATH), not whatever checkout an editable install points at.

Run: python -m pytest tests/test_ray_job_submit.py -q     (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import re
import subprocess

from launch_helpers import RAY_CLI, REPO, quiet_env
from node_loss import rehearsal_cluster, run_args

from workers.trainer.ledger import audit_checkpoint

STEPS = 8  # one checkpoint (run_args: every 8 steps)


def test_ray_job_submit_trains_and_its_logs_read_back(tmp_path):
    sim = rehearsal_cluster()
    try:
        run_dir, job = tmp_path / "run", f"dspark-test-{sim.dashboard_port}"
        env = quiet_env()
        address = f"--address={sim.dashboard}"
        submit = subprocess.run(
            [*RAY_CLI, "job", "submit", address, f"--submission-id={job}", f"--working-dir={REPO}", "--",
             "python", "launch/train_v4_draft.py", "--run-dir", str(run_dir), *run_args(STEPS)],
            env=env, capture_output=True, text=True, timeout=900)
        out = submit.stdout + submit.stderr
        (tmp_path / "submit.log").write_text(out)
        assert submit.returncode == 0, out[-4000:]
        assert f"Job '{job}' succeeded" in out, out[-4000:]
        status = subprocess.run([*RAY_CLI, "job", "status", address, job], env=env, capture_output=True, text=True,
                                timeout=120)
        assert status.returncode == 0 and f"Job '{job}' succeeded" in status.stdout + status.stderr, \
            status.stdout + status.stderr
        logs = subprocess.run([*RAY_CLI, "job", "logs", address, job], env=env, capture_output=True, text=True,
                              timeout=120)
        assert logs.returncode == 0, logs.stderr[-2000:]
        # the driver's lines and rank 0's, as the job wrote them
        assert re.search(rf"training \S+ draft \(.*\) for {STEPS} steps on 2 trainer\(s\); fresh start", logs.stdout), \
            logs.stdout[-4000:]
        assert f"step {STEPS}/{STEPS} | loss" in logs.stdout, logs.stdout[-4000:]
    finally:
        sim.stop()
    audit = audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert audit.exactly_once and audit.steps == STEPS and audit.batches == 2 * STEPS, audit.line()
