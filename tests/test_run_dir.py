"""The run dir is checked first, through the launch script's own `main` in this process (no Ray, no target): a run
dir that is a file, not writable, or held by another live driver is one line and exit status 2 before anything
else happens; a run refused later leaves no run dir behind. The real two-driver and driver-SIGKILL runs are in
tests/test_faults.py (slow).

Run: python -m pytest tests/test_run_dir.py -q     (about 10 s; 30 s on the shared 2-core machine under load)
"""

from __future__ import annotations

import errno
import importlib.util
import os
from pathlib import Path

import pytest
from launch_helpers import LAUNCH, TINY_MOE

from workers.lease import LEASE_FILE, Lease, read_lease


def _main():
    spec = importlib.util.spec_from_file_location("train_v4_draft", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture
def launch(monkeypatch, capsys):
    """main(args) -> (exit status, stderr lines); fails the test if the run got as far as resolving inputs."""
    import workers.inputs

    def too_far(*_a, **_k):
        raise AssertionError("the run dir must be checked before the target is resolved and the data tokenized")

    monkeypatch.setattr(workers.inputs, "resolve_inputs", too_far)
    main = _main()

    def run(*args: str) -> tuple[int, list[str]]:
        code = main([*args, *TINY_MOE])
        return code, capsys.readouterr().err.strip().splitlines()

    return run


def test_a_run_dir_that_is_a_file(tmp_path, launch):
    f = tmp_path / "run"
    f.write_text("not a dir")
    assert launch("--run-dir", str(f)) == (2, [f"error: run dir {f} is a file, not a directory"])
    assert launch("--run-dir", str(f / "sub")) == (2, [f"error: cannot create run dir {f / 'sub'}: Not a directory"])


def test_a_run_dir_that_is_not_writable(tmp_path, launch, monkeypatch):
    def read_only(self, data):  # as on a read-only mount (root ignores permission bits, so simulated)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    (tmp_path / "ro").mkdir()
    assert launch("--run-dir", str(tmp_path / "ro")) == (
        2, [f"error: run dir {tmp_path / 'ro'} is not writable: Read-only file system"])
    assert list((tmp_path / "ro").iterdir()) == []


def test_a_run_dir_in_use_by_another_driver(tmp_path, launch):
    with Lease.acquire(tmp_path / "run") as held:
        (tmp_path / "run" / "config.yaml").write_text("the first run's")
        code, lines = launch("--run-dir", str(tmp_path / "run"))
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"error: run dir {tmp_path / 'run'} is in use by pid {os.getpid()} on host "), lines
        assert read_lease(tmp_path / "run" / LEASE_FILE) == held.record  # untouched
        assert (tmp_path / "run" / "config.yaml").read_text() == "the first run's"


def test_a_bad_input_after_the_lease_leaves_no_run_dir_and_no_lease(tmp_path, monkeypatch, capsys):
    """The lease makes the run dir; a run refused before it writes anything removes it again (and a run dir that
    existed keeps only its released lease)."""
    import workers.inputs
    from pipeline.errors import InputError

    def no_samples(*_a, **_k):
        raise InputError("no samples in data.source")

    monkeypatch.setattr(workers.inputs, "resolve_inputs", no_samples)
    main = _main()
    assert main(["--single-process", "--run-dir", str(tmp_path / "r"), *TINY_MOE]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: no samples in data.source"
    assert not (tmp_path / "r").exists()


def test_a_trainer_whose_lease_was_taken_over_stops_before_the_next_checkpoint(tmp_path):
    """The shared loop (workers/trainer/loop.fit) through the single-process trainer: after step 1 another driver
    takes the run dir over (generation 2); at the end of step 2 this one stops with LeaseLost, before step 2's
    metrics row and checkpoint, and the new owner's state is untouched."""
    import logging

    from pipeline.config import load_config
    from pipeline.metrics import read_jsonl_metrics
    from workers.lease import LeaseLost
    from workers.trainer.single_process import train_single_process

    run_dir = tmp_path / "run"
    cfg = load_config(LAUNCH.parents[0] / "configs" / "tiny.yaml",
                      [*TINY_MOE, f"checkpoint.run_dir={run_dir}", "train.max_steps=4", "checkpoint.every_steps=1",
                       "checkpoint.export=false", "data.num_samples=16"])
    old = Lease.acquire(run_dir, heartbeat=False)
    fence = old.fence()
    taken: list[Lease] = []

    class TakeOverAfterStep1:
        def check(self):
            if (run_dir / "checkpoints" / "step_00000001").is_dir() and not taken:
                # a driver that judges leases with a ttl of ~0 finds this one stale and takes the run dir over
                taken.append(Lease.acquire(run_dir, ttl_s=1e-9, heartbeat=False))
            return fence.check()

        def check_commit(self):
            fence.check_commit()

    with pytest.raises(LeaseLost, match="stopping at step 2, before its checkpoint and metrics: run dir .* was "
                                        "taken over by .*lease generation 2, this trainer's is 1"):
        train_single_process(cfg, logging.getLogger("test"), device="cpu", fence=TakeOverAfterStep1())
    assert taken and taken[0].generation == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert sorted(read_jsonl_metrics(run_dir / "metrics.jsonl")) == [1]
