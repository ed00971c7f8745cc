"""A whole worker node lost mid-run, on a simulated multi-node Ray cluster (bench/node_loss.rehearsal_cluster: a head
with no CPUs, two trainer nodes and two target nodes, all on loopback), through the real launch script (real Ray Train
+ DeepSpeed ZeRO-2, 2 trainers, two tiny random Qwen3-MoE target workers), each node killed as a whole (its raylet and
every process on it, SIGKILL, no drain):

- a target node: the feature service notices the dead node, says so in one line, trains on with the worker left
  (steps are trained before any capacity comes back), re-issues what was in flight there, and re-creates the lost
  worker once a node with a `target_worker` slot joins;
- a trainer node (slow), with elastic trainers (cluster.min_trainers=1): Ray Train restarts the group on the trainer
  left, which keeps the global batch (grad_accum 2), and grows it back to 2 when a trainer node joins;
- both at once (slow; bench/node_loss.py's rehearsal with both kills at one step);
- where the run cannot go on (slow): a fixed trainer group that lost a node and gets none back ends after
  cluster.trainer_wait_s with status 69, and a lost head ends a driver off it with status 69; each time the same
  command submitted again (on a new cluster for the head) resumes from the newest sealed checkpoint.

Each run finishes with the losses of the same run without a fault (1e-5; the both-at-once rehearsal: its last line)
and a ledger that shows every sample trained exactly once.

Run: python -m pytest tests/test_node_loss.py -q     (the target node: about 3 minutes on 2 cores, the cluster and an
     unfaulted run included; -m slow adds the other four, about 20 minutes more)
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import logged_steps
from node_loss import ELASTIC, rehearsal_cluster, run_args
from sim_cluster import SimCluster, launch_on

from pipeline.metrics import read_jsonl_metrics
from workers.trainer.ledger import audit_checkpoint

STEPS = 80  # long enough for a lost worker to be re-created, a trainer group to shrink and grow back
ARGS = run_args(STEPS)  # the rehearsal's run (bench/node_loss.py): fp32 loss matmuls, each worker on a node


@pytest.fixture(scope="module")
def sim():
    s = rehearsal_cluster()  # bench/node_loss.py's: a head with no CPUs, 2 trainer nodes, 2 target nodes
    try:
        yield s
    finally:
        s.stop()


def _launch(run_dir: Path, log: Path, sim: SimCluster, *extra: str) -> subprocess.Popen:
    return launch_on(sim, run_dir, log, [*ARGS, *extra])


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
    _same_run(run_dir, clean)


def _same_run(run_dir: Path, clean: dict[int, float]) -> None:
    """Every step's loss that of the unfaulted run, every sample trained once (the ledger's audit)."""
    losses = {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}
    assert sorted(losses) == sorted(clean) == list(range(1, STEPS + 1))
    for s in losses:
        assert losses[s] == pytest.approx(clean[s], rel=1e-5, abs=1e-7), (s, losses[s], clean[s])
    audit = audit_checkpoint(run_dir / "checkpoints" / f"step_{STEPS:08d}")
    assert audit.exactly_once and audit.steps == STEPS and audit.batches == 2 * STEPS, audit.line()
    assert audit.samples_trained == 2 * STEPS * 4


@pytest.mark.slow
def test_a_lost_trainer_node_the_group_shrinks_at_once_and_grows_back(sim, clean, tmp_path):
    """Elastic trainers (cluster.min_trainers=1): the node of one of the 2 trainers is killed; Ray Train restarts the
    group at once on the trainer left (no waiting for a replacement), which resumes from the last checkpoint with
    grad_accum 2 (the same global batch, the same batches per step), and grows back to 2 when a trainer node joins."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = _launch(run_dir, log, sim, *ELASTIC)
    try:
        _wait("step 10", lambda: logged_steps(run_dir) >= 10, 600, proc, log)
        sim.kill("trainers-1")
        at_kill = logged_steps(run_dir)
        shrunk = "elastic: training on 1 of 2 trainers (grad_accum 2, global batch 2 unchanged)"
        detect_s = _wait("the shrunk group", lambda: shrunk in log.read_text(), 300, proc, log)
        # the one-trainer group trains past the step of the kill before any capacity comes back
        _wait("the one-trainer group's steps", lambda: shrunk in log.read_text() and logged_steps(run_dir) > at_kill,
              300, proc, log)
        sim.add("trainers-2", num_cpus=1, resources={"trainer": 1})
        grown = "Deciding to resize the worker group from 1 -> 2 workers"  # Ray Train's line
        _wait("the group grown back", lambda: grown in log.read_text(), 300, proc, log)
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        proc.kill()
    text = log.read_text()
    assert text.count(shrunk) == 1, text[-4000:]
    # Ray Train's first restart asks for 2 trainers while the GCS has not yet declared the node dead, and waits its
    # worker-group start timeout (60 s) before it shrinks (docs/fault-tolerance.md, "A node dies")
    assert detect_s < 180, detect_s
    # two trainers again: the run's last steps were trained by a group of 2
    assert text.rfind("Started training worker group of size 2") > text.rfind(shrunk), text[-4000:]
    _same_run(run_dir, clean)


@pytest.mark.slow
def test_a_fixed_group_that_lost_its_node_ends_for_a_retry_and_the_resubmission_resumes(sim, clean, tmp_path):
    """A fixed group of 2 trainers (cluster.min_trainers=0) loses a trainer node and no node comes back: the driver
    says what it waits for, ends after cluster.trainer_wait_s with status 69 (what a Job's backoffLimit retries), and
    the same command submitted again once a trainer node has joined resumes from the newest sealed checkpoint: the
    run's losses and ledger are those of a run without the fault."""
    from workers.trainer_capacity import UNAVAILABLE_EXIT

    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    wait = ["cluster.trainer_wait_s=20"]
    proc = _launch(run_dir, log, sim, *wait)
    try:
        _wait("step 10", lambda: logged_steps(run_dir) >= 10, 600, proc, log)
        sim.kill(next(n for n in sim.nodes if n.startswith("trainers-")))
        t0 = time.time()
        assert proc.wait(timeout=300) == UNAVAILABLE_EXIT, log.read_text()[-4000:]
        ended_s = time.time() - t0
    finally:
        proc.kill()
    text = log.read_text()
    said = (r"the cluster's live nodes hold 1 of the 2 trainer\(s\) the trainer group \(cluster.num_trainers\) needs "
            r"\(\{CPU: 1, trainer: 1\} each\): waiting for a node with that capacity up to 20 s")
    assert re.search(said, text), text[-4000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: the cluster's live nodes held 1 of the 2 trainer(s)") and \
        "a resubmission of the same command resumes from the newest checkpoint" in last, text[-4000:]
    assert 20 < ended_s < 120, ended_s  # the GCS's 3 s, the wait, the shutdown
    sealed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))[-1]

    sim.add(f"trainers-{len(sim.nodes) + 10}", num_cpus=1, resources={"trainer": 1})
    again = tmp_path / "again.log"
    proc = _launch(run_dir, again, sim, *wait)
    try:
        assert proc.wait(timeout=600) == 0, again.read_text()[-4000:]
    finally:
        proc.kill()
    assert f"resuming from {run_dir / 'checkpoints' / sealed}" in again.read_text(), again.read_text()[-4000:]
    _same_run(run_dir, clean)


@pytest.mark.slow
def test_a_lost_head_ends_the_run_in_one_line_and_a_new_cluster_resumes_it(clean, tmp_path):
    """The head node dies as a whole (its GCS and raylet) under a driver that runs off it (a driver on the head dies
    with it, as under `ray job submit`): the driver ends in one line with status 69 instead of Ray's minute of errors
    and its exit 1, and the same command on a new cluster (what a RayJob's backoffLimit does) resumes from the newest
    sealed checkpoint to the unfaulted run's losses and an exactly-once ledger. Its own cluster: the module's stays."""
    from workers.trainer_capacity import UNAVAILABLE_EXIT

    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    first = rehearsal_cluster()
    try:
        proc = _launch(run_dir, log, first)
        try:
            _wait("step 10", lambda: logged_steps(run_dir) >= 10, 600, proc, log)
            first.kill_head()
            t0 = time.time()
            assert proc.wait(timeout=120) == UNAVAILABLE_EXIT, log.read_text()[-4000:]
            ended_s = time.time() - t0
        finally:
            proc.kill()
    finally:
        first.stop()
    text = log.read_text()
    assert re.search(r"\nerror: lost the Ray head: its GCS at 127\.0\.0\.1:\d+ has not answered for 1\d s; the run "
                     r"cannot go on without it: a resubmission of the same command .* resumes from the newest "
                     r"checkpoint\n",
                     text), text[-4000:]
    assert 15 < ended_s < 60, ended_s
    sealed = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))[-1]

    second = rehearsal_cluster()
    try:
        again = tmp_path / "again.log"
        proc = _launch(run_dir, again, second)
        try:
            assert proc.wait(timeout=600) == 0, again.read_text()[-4000:]
        finally:
            proc.kill()
    finally:
        second.stop()
    assert f"resuming from {run_dir / 'checkpoints' / sealed}" in again.read_text(), again.read_text()[-4000:]
    _same_run(run_dir, clean)


@pytest.mark.slow
def test_a_trainer_node_and_a_target_node_lost_at_once(capsys):
    """Both kinds of node killed at the same step (bench/node_loss.py with both kills at step 20, back to back): the
    run goes on, on the trainer and the target worker left, grows back when a trainer node joins, and its ledger
    shows every sample trained exactly once."""
    from node_loss import main

    rc = main(["--target-kill-at", "20", "--trainer-kill-at", "20"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert rc == 0, out
    assert re.fullmatch(r"node_loss nodes=5 killed=2 survived=yes detect_s=\d+\.\d recover_s=\d+\.\d lost_steps=\d+ "
                        r"duplicates=0 missing=0", last), out
    assert re.search(r"step (\d+): killed node target-1 \(target\)\nstep \1: killed node trainers-1 \(trainer\)\n",
                     out), out  # the same step, back to back
