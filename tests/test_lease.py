"""The run dir's lease (workers/lease.py): acquire, refuse with one line, renew, take over a stale lease with
generation + 1, release, and fence out trainers of an older generation. All in-process on a temp dir, except one
driver stand-in process that is SIGKILLed.

Run: python -m pytest tests/test_lease.py -q     (about 3 s)
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workers.lease import (
    LEASE_FILE,
    Lease,
    LeaseLost,
    RunDirInUse,
    RunDirUnusable,
    read_lease,
)

REPO = Path(__file__).resolve().parents[1]
IN_USE = re.compile(r"^run dir (\S+) is in use by pid (\d+) on host (\S+) \(job (\S+)\) since "
                    r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) \(lease renewed \d+ s ago; one not renewed for \d+ s is "
                    r"taken over\)$")


def test_acquire_refuse_release_and_the_next_generation(tmp_path):
    run_dir = tmp_path / "run"
    lease = Lease.acquire(run_dir, heartbeat=False)
    assert lease.generation == 1 and lease.created_dir
    rec = read_lease(run_dir / LEASE_FILE)
    assert rec == lease.record and rec.pid == os.getpid() and not rec.released
    assert (run_dir / LEASE_FILE).stat().st_size == 1024 and not list(run_dir.glob("lease.json.*"))

    with pytest.raises(RunDirInUse) as info:
        Lease.acquire(run_dir, heartbeat=False)
    line = str(info.value)
    m = IN_USE.match(line)
    assert m, line
    assert m.group(1) == str(run_dir) and int(m.group(2)) == os.getpid() and m.group(4) == "local"

    (run_dir / "config.yaml").write_text("x")  # the run wrote something: the dir stays
    lease.release()
    assert read_lease(run_dir / LEASE_FILE).released
    with Lease.acquire(run_dir, heartbeat=False) as again:
        assert again.generation == 2  # never 1 again: trainers of generation 1 stay fenced out
        assert not again.created_dir


def test_a_run_dir_the_lease_made_and_nothing_used_is_removed_on_release(tmp_path):
    run_dir = tmp_path / "a" / "run"
    Lease.acquire(run_dir, heartbeat=False).release()
    assert not run_dir.exists() and (tmp_path / "a").is_dir()


def test_renew_rewrites_the_record_in_place(tmp_path):
    lease = Lease.acquire(tmp_path, heartbeat=False)
    before = read_lease(tmp_path / LEASE_FILE)
    inode = (tmp_path / LEASE_FILE).stat().st_ino
    time.sleep(0.02)
    assert lease.renew()
    after = read_lease(tmp_path / LEASE_FILE)
    assert after.renewed_at > before.renewed_at and after.since == before.since
    assert (tmp_path / LEASE_FILE).stat().st_ino == inode
    lease.release()


def test_the_heartbeat_keeps_a_lease_alive_past_its_ttl(tmp_path):
    lease = Lease.acquire(tmp_path, renew_s=0.05, ttl_s=0.3)
    time.sleep(0.6)
    with pytest.raises(RunDirInUse):
        Lease.acquire(tmp_path, ttl_s=0.3, heartbeat=False)
    lease.release()


def test_a_stale_lease_is_taken_over_with_the_next_generation_and_its_trainers_are_fenced(tmp_path):
    old = Lease.acquire(tmp_path, ttl_s=0.2, heartbeat=False)
    old_fence = old.fence()
    assert old_fence.check() is None
    old_fence.check_commit()
    time.sleep(0.3)  # no heartbeat: stale
    assert "has not renewed its lease" in old_fence.check()

    new = Lease.acquire(tmp_path, ttl_s=0.2, heartbeat=False)
    assert new.generation == 2
    reason = old_fence.check()
    assert reason.startswith(f"run dir {tmp_path} was taken over by pid {os.getpid()}") and \
        "lease generation 2, this trainer's is 1" in reason, reason
    with pytest.raises(LeaseLost, match="checkpoint commit refused: run dir .* was taken over"):
        old_fence.check_commit()
    new.fence().check_commit()

    assert not old.renew() and old.lost.is_set()  # the old holder finds out at its next heartbeat
    assert read_lease(tmp_path / LEASE_FILE) == new.record  # ...and did not overwrite the new lease
    old.release()  # releases nothing: it is not its lease any more
    assert not read_lease(tmp_path / LEASE_FILE).released
    new.release()


def test_a_released_lease_stops_its_trainers(tmp_path):
    lease = Lease.acquire(tmp_path, heartbeat=False)
    (tmp_path / "metrics.jsonl").write_text("")
    fence = lease.fence()
    lease.release()
    assert "released run dir" in fence.check()


def test_a_dead_driver_on_this_machine_is_taken_over_at_once(tmp_path):
    """kill -9 of the driver, then a new driver at once: the pid is gone, no need to wait for the ttl."""
    code = ("import sys, time; from workers.lease import Lease; Lease.acquire(sys.argv[1]); print('held', "
            "flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUse, match=f"in use by pid {proc.pid} "):
            Lease.acquire(tmp_path, heartbeat=False)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    with Lease.acquire(tmp_path, heartbeat=False) as lease:  # the default 30 s ttl has not passed
        assert lease.generation == 2


def test_racing_takers_one_wins(tmp_path):
    old = Lease.acquire(tmp_path, heartbeat=False)
    (tmp_path / "config.yaml").write_text("")
    old.release()  # free for the next driver: four come at once
    results: list = []
    go = threading.Barrier(4)

    def take() -> None:
        go.wait()
        try:
            results.append(Lease.acquire(tmp_path, ttl_s=60, heartbeat=False))
        except Exception as e:  # noqa: BLE001 - anything but RunDirInUse fails the assert below
            results.append(e)

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if isinstance(r, Lease)]
    assert all(isinstance(r, (Lease, RunDirInUse)) for r in results), results
    assert len(winners) == 1 and winners[0].generation == 2, results
    assert read_lease(tmp_path / LEASE_FILE) == winners[0].record
    assert not list(tmp_path.glob("lease.json.*"))  # no private or aside file left behind


def test_a_run_dir_that_is_a_file_or_not_writable_is_one_line(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirUnusable, match=f"^run dir {f} is a file, not a directory$"):
        Lease.acquire(f)
    with pytest.raises(RunDirUnusable, match=f"^cannot create run dir {f / 'run'}: Not a directory$"):
        Lease.acquire(f / "run")

    def read_only(self, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "write_bytes", read_only)  # the lease's own write is the writability check
    (tmp_path / "ro").mkdir()
    with pytest.raises(RunDirUnusable, match=f"^run dir {tmp_path / 'ro'} is not writable: Read-only file system$"):
        Lease.acquire(tmp_path / "ro")


def test_a_foreign_lease_file_is_one_line(tmp_path):
    (tmp_path / LEASE_FILE).write_text("hello")
    with pytest.raises(RunDirUnusable, match="is not a lease this code wrote"):
        Lease.acquire(tmp_path)


def test_a_lease_that_missed_two_heartbeats_is_waited_for_not_refused(tmp_path):
    """A driver restarted on another node right after the old one died (a RayJob retry) would otherwise fail for
    up to the ttl; it waits for the lease to expire and takes over. A renewal meanwhile ends the wait: refused."""
    Lease.acquire(tmp_path / "dead", heartbeat=False, ttl_s=1.0, renew_s=0.1)  # never renewed
    time.sleep(0.25)
    t0 = time.time()
    with Lease.acquire(tmp_path / "dead", ttl_s=1.0, renew_s=0.1, heartbeat=False) as lease:
        assert lease.generation == 2 and 0.5 < time.time() - t0 < 2.0

    slow = Lease.acquire(tmp_path / "slow", ttl_s=1.0, renew_s=0.6)  # alive, renewing every 0.6 s
    time.sleep(0.3)
    with pytest.raises(RunDirInUse):  # waited (0.3 s > two of the taker's 0.1 s heartbeats), then saw a renewal
        Lease.acquire(tmp_path / "slow", ttl_s=1.0, renew_s=0.1, heartbeat=False)
    slow.release()
