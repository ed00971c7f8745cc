"""A whole worker node lost mid-run, on a simulated multi-node Ray cluster (bench/sim_cluster.py: a head with no CPUs,
a trainer node, two target nodes, all on loopback), through the real launch script (real Ray Train + DeepSpeed ZeRO-2,
2 trainers, two tiny random Qwen3-MoE target workers, one per target node).

The node holding a target worker is killed as a whole (its raylet and every process on it, SIGKILL, no drain): the
feature service notices the dead node, says so in one line, trains on with the worker left (steps are trained before
any capacity comes back), re-issues what was in flight there, and re-creates the lost worker once a node with a
`target_worker` slot joins; the run finishes with the losses of the same run without the loss, and the ledger shows
every sample trained exactly once.

Run: python -m pytest tests/test_node_loss.py -q     (about 3 minutes on 2 cores: the cluster, an unfaulted run, the
     faulted one)
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import LAUNCH, REPO, TINY_MOE, logged_steps, quiet_env
from sim_cluster import SimCluster

from pipeline.metrics import read_jsonl_metrics
from workers.trainer.ledger import audit_checkpoint

STEPS = 40  # long enough for the lost worker to be re-created before the end
ARGS = ["--max-steps", str(STEPS), *TINY_MOE, "checkpoint.every_steps=8", "train.lr=3e-3", "target.num_workers=2",
        "target.resources_per_worker={target_worker: 1}", "cluster.resources_per_trainer={trainer: 1}",
        "target.batch_timeout_s=300"]


@pytest.fixture(scope="module")
def sim():
    s = SimCluster(head_cpus=0)  # the driver's node runs no worker: only the driver and its zero-CPU actors
    try:
        s.add("trainers", num_cpus=2, resources={"trainer": 2})
        for name in ("target-0", "target-1"):
            s.add(name, num_cpus=1, resources={"target_worker": 1})
        yield s
    finally:
        s.stop()


def _launch(run_dir: Path, log: Path, sim: SimCluster) -> subprocess.Popen:
    with open(log, "w") as out:
        # PYTHONPATH: this checkout's code, also where an editable install of another checkout would win
        return subprocess.Popen([sys.executable, str(LAUNCH), "--run-dir", str(run_dir), *ARGS], cwd=REPO,
                                env=quiet_env(RAY_ADDRESS=sim.address, PYTHONPATH=str(REPO)), stdout=out,
                                stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def clean(sim, tmp_path_factory):
    """The same run with no node lost: its losses, step by step."""
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    proc = _launch(run_dir, run_dir.parent / "run.log", sim)
    assert proc.wait(timeout=600) == 0, (run_dir.parent / "run.log").read_text()[-4000:]
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def _wait(what: str, cond, timeout: float, proc: subprocess.Popen, log: Path) -> float:
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) waiting for {what}: {log.read_text()[-4000:]}"
        assert time.time() - t0 < timeout, f"timed out waiting for {what}: {log.read_text()[-4000:]}"
        time.sleep(0.2)
    return time.time() - t0


def test_a_lost_target_node_the_run_goes_on_and_trains_every_sample_once(sim, clean, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(run_dir, log, sim)
    try:
        _wait("step 3", lambda: logged_steps(run_dir) >= 3, 600, proc, log)
        sim.kill("target-1")
        at_kill = logged_steps(run_dir)
        lost = re.compile(r"lost node (\w{8}) \(target worker (\d) on it\): training goes on with 1 of 2 target "
                          r"worker\(s\); \d+ prefetched batch\(es\) re-issued to them, batches in flight there are "
                          r"asked for again by their trainers; target worker \2 is re-created when a node with "
                          r"\{target_worker: 1, CPU: 1\} joins")
        detect_s = _wait("the lost-node line", lambda: lost.search(log.read_text()), 60, proc, log)
        assert detect_s < 30, detect_s  # GCS: 3 missed checks of 1 s (bench/sim_cluster.py), then one poll
        # no capacity came back, yet training goes on, on the worker left
        _wait("two steps trained after the kill", lambda: logged_steps(run_dir) >= at_kill + 2, 180, proc, log)
        assert logged_steps(run_dir) < STEPS, "the run ended before the lost worker could be re-created: lengthen it"
        sim.add("target-2", num_cpus=1, resources={"target_worker": 1})
        worker = lost.search(log.read_text()).group(2)
        _wait("the re-created worker", lambda: f"target worker {worker} re-created" in log.read_text(), 300, proc, log)
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert len(lost.findall(text)) == 1, text[-4000:]  # one line for the one lost node
    assert re.search(rf"target worker {worker} re-created \d+ s after its node was lost: 2 of 2 target worker\(s\) "
                     "serving", text), text[-4000:]
    # the batches re-issued are the batches lost (a batch is a function of its index): the unfaulted run's curve
    losses = {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}
    assert sorted(losses) == sorted(clean) == list(range(1, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(clean[s], rel=1e-5, abs=1e-7), (s, losses[s], clean[s])
    audit = audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert audit.exactly_once and audit.steps == STEPS and audit.batches == 2 * STEPS, audit.line()
    assert audit.samples_trained == 2 * STEPS * 4
