"""One driver owns a run dir: a lease file, renewed by a heartbeat, taken over with a new generation when stale;
and the fence that keeps trainers of an older generation from committing into the run.

Why a lease file and not flock: run dirs live on local disks and on file systems shared by several pods (NFS, a
ReadWriteMany PVC), where flock/fcntl locks may be emulated per client, not honoured at all, or outlive a dead
client until the server's lock recovery. What NFS (v3 and v4) and every local file system do guarantee is that
`link()` to an existing name fails (exclusive create, the classic NFS-safe lock), that `rename()` is atomic, and
that `open()` sees the latest content written by another client (close-to-open consistency). The lease uses only
those. docs/fault-tolerance.md ("One driver per run dir") has the whole rule.

`<run_dir>/lease.json`, one fixed-width JSON record (LEASE_BYTES):
    generation   1 for a new run dir, +1 at every takeover; handed to the trainers and checked at commit
    token        random: tells this holder from any other (a pid can repeat across hosts and reboots)
    pid, pid_start, host, node, job, since   who holds it (node: boot id + pid namespace, to test the pid)
    renewed_at   the holder's wall clock at its last heartbeat (every RENEW_S)
    released     the holder exited normally (or on an error or signal it handled)

- acquire: a new lease is written to a private file, then `link`ed to lease.json, so it appears whole and only one
  of two racing drivers gets it. A live lease refuses (RunDirInUse, one line, exit 2). A stale one (released; not
  renewed for TTL_S = 6 missed heartbeats; or held by a pid that no longer runs on this same machine) is taken
  over with generation + 1: the taker first claims that generation exclusively (`link` to lease.claim.<gen>; of
  racing takers one wins), re-reads lease.json to be sure it still holds the record judged stale, and renames its
  own record over it (atomic: lease.json is never missing). A lease that already missed two heartbeats is waited
  for (up to TTL_S) rather than refused: a driver restarted on another node right after the old one died succeeds.
- renew: the holder rewrites its record in place through the descriptor it holds (pwrite + fsync), so a lease
  that was taken over (its inode replaced) is never resurrected by its old holder; then it re-reads lease.json
  by name, and another token there means the lease was lost (`Lease.lost`).
- Fence (travels to the trainers): `check()` once per step (another generation, a released lease, or no renewal
  for TTL_S: the driver is gone, stop) and `check_commit()` before a checkpoint's .tmp clean-up and before its
  rename, `latest` and pruning (another generation or no lease: refuse).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipeline.errors import InputError
from pipeline.metrics import get_logger

LEASE_FILE = "lease.json"
LEASE_BYTES = 1024  # fixed width: a renewal rewrites the record in place, whole
RENEW_S = 5.0  # heartbeat period
TTL_S = 30.0  # a lease not renewed for this long (6 missed heartbeats) is stale; clocks must agree far better
CLAIM_PREFIX = "lease.claim."  # lease.claim.<generation>: made exclusively by the one driver taking over
CLAIM_GRACE_S = 10.0  # a claim older than this belongs to a taker that died before it finished

log = get_logger("dspark.lease")


class RunDirInUse(InputError):
    """Another live driver holds the run dir (exit status 2)."""


class RunDirUnusable(InputError):
    """The run dir is a file, or cannot be created or written (exit status 2)."""


class LeaseLost(RuntimeError):
    """This process's generation no longer owns the run dir: its driver is gone or another driver took over."""


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    token: str
    pid: int
    pid_start: str
    host: str
    node: str
    job: str
    since: float
    renewed_at: float
    released: bool = False

    def encode(self) -> bytes:
        data = json.dumps(asdict(self), separators=(",", ":")).encode()
        assert len(data) < LEASE_BYTES, len(data)
        return data.ljust(LEASE_BYTES - 1) + b"\n"

    def holder(self) -> str:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} (job {self.job}) since {since}"


def read_lease(path: Path, attempts: int = 5) -> LeaseRecord | None:
    """The record in lease file `path`, None when there is none. A read that overlaps a renewal (the record is
    rewritten in place) may be torn: read again."""
    for i in range(attempts):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RunDirUnusable(f"cannot read {path}: {e.strerror or type(e).__name__}") from None
        try:
            return LeaseRecord(**json.loads(data))
        except (ValueError, TypeError):
            if i == attempts - 1:
                raise RunDirUnusable(f"{path} is not a lease this code wrote; if no driver uses the run dir, remove "
                                     "it") from None
            time.sleep(0.01)
    raise AssertionError("unreachable")


def _node() -> str:
    """This machine and pid namespace: a pid means the same process only within both."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return boot


def _pid_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc has none): a reused pid differs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()
    return "" if fields[0] == "Z" else fields[19]  # a zombie has exited


def _job() -> str:
    """The Ray job submission id when run by `ray job submit` (KubeRay's RayJob too), else 'local'."""
    try:
        meta = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")).get("metadata", {})
    except ValueError:
        meta = {}
    return str(meta.get("job_submission_id") or os.environ.get("SLURM_JOB_ID") or "local")[:200]


def stale_because(rec: LeaseRecord, now: float, ttl_s: float) -> str | None:
    """Why the lease `rec` no longer holds (None: it does)."""
    if rec.released:
        return "released"
    if now - rec.renewed_at > ttl_s:
        return f"not renewed for {now - rec.renewed_at:.0f} s"
    if rec.node == _node() and rec.pid_start and _pid_start(rec.pid) != rec.pid_start:
        return f"pid {rec.pid} is gone"
    return None


def in_use_message(run_dir: Path, rec: LeaseRecord, now: float, ttl_s: float) -> str:
    return (f"run dir {run_dir} is in use by {rec.holder()} (lease renewed {max(0.0, now - rec.renewed_at):.0f} s "
            f"ago; one not renewed for {ttl_s:.0f} s is taken over)")


def _unusable(run_dir: Path, e: OSError) -> RunDirUnusable:
    why = e.strerror or type(e).__name__
    return RunDirUnusable(f"run dir {run_dir} is not writable: {why}")


def _check_dir(run_dir: Path) -> bool:
    """Make the run dir if needed (RunDirUnusable, one line, if it cannot be); True if this call made it."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirUnusable(f"run dir {run_dir} is a file, not a directory")
    if run_dir.is_dir():
        return False
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        return False  # made by a racing driver: the lease decides
    except OSError as e:
        raise RunDirUnusable(f"cannot create run dir {run_dir}: {e.strerror or type(e).__name__}") from None
    return True


def _link_exclusive(src: Path, dst: Path) -> bool:
    """link(src, dst): True if dst is now src's inode, False if dst existed. On NFS a retransmitted LINK can
    report an error although it worked: the link count says."""
    try:
        os.link(src, dst)
        return True
    except FileExistsError:
        return False
    except OSError:
        if os.stat(src).st_nlink == 2:
            return True
        raise


class Lease:
    """The run dir's lease, held by this process (the driver) from `acquire` to `release`."""

    def __init__(self, run_dir: Path, record: LeaseRecord, fd: int, created_dir: bool, renew_s: float,
                 ttl_s: float) -> None:
        self.run_dir, self.path, self.record, self._fd = run_dir, run_dir / LEASE_FILE, record, fd
        self.created_dir, self.renew_s, self.ttl_s = created_dir, renew_s, ttl_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._missing = 0

    @property
    def generation(self) -> int:
        return self.record.generation

    def fence(self) -> Fence:
        return Fence(str(self.run_dir), self.record.generation, self.record.token, self.ttl_s)

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, renew_s: float = RENEW_S, ttl_s: float = TTL_S,
                heartbeat: bool = True) -> Lease:
        """Take the run dir (making it if needed) or raise RunDirInUse / RunDirUnusable, one line each."""
        run_dir = Path(run_dir)
        created = _check_dir(run_dir)
        path = run_dir / LEASE_FILE
        token = secrets.token_hex(8)
        waited_for = None  # the holder whose lease we wait to expire
        for _ in range(50 + int(ttl_s / min(renew_s, ttl_s) * 2)):  # races with other takers, and the wait below
            now = time.time()
            current = read_lease(path)
            if current is not None and stale_because(current, now, ttl_s) is None:
                age = now - current.renewed_at
                if age <= 2 * renew_s or (waited_for is not None and waited_for != current.token):
                    raise RunDirInUse(in_use_message(run_dir, current, now, ttl_s))
                # two heartbeats missed (its driver died on another node, say: a RayJob's retry): wait for the
                # ttl rather than fail a restart that would succeed seconds later; a renewal ends the wait
                if waited_for is None:
                    log.warning("run dir %s: its lease (%s) was last renewed %.0f s ago; waiting up to %.0f s for it "
                                "to expire", run_dir, current.holder(), age, ttl_s - age)
                waited_for = current.token
                time.sleep(min(renew_s / 2, max(0.01, ttl_s - age)))
                continue
            held = current.generation if current is not None else 0
            claims = _claims(run_dir)
            if any(g > held and now - t < CLAIM_GRACE_S for g, t in claims.items()):
                time.sleep(0.05)  # another driver is taking it over right now: see who won
                continue
            record = LeaseRecord(generation=max([held, *claims]) + 1, token=token, pid=os.getpid(),
                                 pid_start=_pid_start(os.getpid()), host=socket.gethostname()[:200], node=_node(),
                                 job=_job(), since=now, renewed_at=now)
            mine = path.with_name(f"{LEASE_FILE}.{token}.new")
            try:
                mine.write_bytes(record.encode())
                fd = os.open(mine, os.O_RDWR)
            except OSError as e:
                raise _unusable(run_dir, e) from None
            try:
                won = _link_exclusive(mine, path) if current is None else _take_over(path, mine, current, record)
            finally:
                mine.unlink(missing_ok=True)
            if not won:
                os.close(fd)
                continue
            for g in claims:  # the generations up to ours are settled
                (run_dir / f"{CLAIM_PREFIX}{g}").unlink(missing_ok=True)
            (run_dir / f"{CLAIM_PREFIX}{record.generation}").unlink(missing_ok=True)
            if current is not None:
                log.warning("took over run dir %s from %s (its lease was %s); lease generation %d", run_dir,
                            current.holder(), stale_because(current, now, ttl_s), record.generation)
            lease = cls(run_dir, record, fd, created, renew_s, ttl_s)
            if heartbeat:
                lease.start_heartbeat()
            return lease
        current = read_lease(path)
        raise RunDirInUse(in_use_message(run_dir, current, time.time(), ttl_s) if current else
                          f"run dir {run_dir}: another driver is taking it over right now")

    def renew(self) -> bool:
        """One heartbeat: rewrite our record with the time, then check lease.json still holds our token. False
        (and `lost` set) once another driver took the run dir over."""
        if self.lost.is_set():
            return False
        self.record = replace(self.record, renewed_at=time.time())
        os.pwrite(self._fd, self.record.encode(), 0)
        os.fsync(self._fd)
        current = read_lease(self.path)
        self._missing = self._missing + 1 if current is None else 0
        if (current is not None and current.token != self.record.token) or self._missing > 2:
            self.lost.set()
            log.error("lost the lease of run dir %s: %s", self.run_dir,
                      f"now held by {current.holder()}" if current else "lease.json is gone")
            return False
        return True

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.renew_s):
                try:
                    if not self.renew():
                        return
                except (OSError, InputError) as e:  # a file system hiccup, a torn read: the next beat tries again
                    log.warning("could not renew the lease of run dir %s: %s", self.run_dir, e)

        self._thread = threading.Thread(target=beat, name="run-dir-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Mark the lease released (the next driver takes it with generation + 1, so trainers of this one stay
        fenced out) and remove the run dir if this lease made it and nothing else was written there."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            current = read_lease(self.path)
            if current is not None and current.token == self.record.token and not self.lost.is_set():
                self.record = replace(self.record, released=True, renewed_at=time.time())
                os.pwrite(self._fd, self.record.encode(), 0)
                os.fsync(self._fd)
                if self.created_dir and [p.name for p in self.run_dir.iterdir()] == [LEASE_FILE]:
                    self.path.unlink()
                    self.run_dir.rmdir()  # a run refused before it wrote anything leaves nothing behind
        except (OSError, InputError) as e:  # the exit goes on; the next driver takes the lease once it is stale
            log.warning("could not release the lease of run dir %s (%s); the next driver takes it over after %.0f s",
                        self.run_dir, e, self.ttl_s)
        finally:
            os.close(self._fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _claims(run_dir: Path) -> dict[int, float]:
    """The takeover claims in the run dir: generation -> when it was claimed (the claim's ctime)."""
    out = {}
    for p in run_dir.glob(f"{CLAIM_PREFIX}*"):
        try:
            out[int(p.name[len(CLAIM_PREFIX):])] = p.stat().st_ctime
        except (ValueError, OSError):
            pass  # not ours, or removed by its winner just now
    return out


def _take_over(path: Path, mine: Path, judged: LeaseRecord, record: LeaseRecord) -> bool:
    """Replace the stale lease `judged` with `mine`. Of racing takers only the one whose exclusive claim of the
    next generation succeeds goes on; it replaces lease.json (an atomic rename, so the file is never missing)
    only if it still holds the record it judged stale (else its holder renewed it, and it stays)."""
    if not _link_exclusive(mine, path.with_name(f"{CLAIM_PREFIX}{record.generation}")):
        return False
    if read_lease(path) != judged:
        path.with_name(f"{CLAIM_PREFIX}{record.generation}").unlink(missing_ok=True)
        return False
    os.replace(mine, path)
    return True


@dataclass(frozen=True)
class Fence:
    """What the trainers get of the lease: the run dir and the generation they belong to."""

    run_dir: str
    generation: int
    token: str
    ttl_s: float = TTL_S

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / LEASE_FILE

    def _foreign(self, rec: LeaseRecord | None) -> str | None:
        if rec is None:
            return f"{self.path} is gone"
        if rec.generation != self.generation or rec.token != self.token:
            return (f"run dir {self.run_dir} was taken over by {rec.holder()} (lease generation {rec.generation}, "
                    f"this trainer's is {self.generation})")
        return None

    def check(self) -> str | None:
        """Once per step on every trainer rank: why this trainer must stop (None: train on)."""
        rec = read_lease(self.path)
        reason = self._foreign(rec)
        if reason is None and rec.released:
            reason = f"the driver ({rec.holder()}) released run dir {self.run_dir}"
        if reason is None and time.time() - rec.renewed_at > self.ttl_s:
            reason = (f"the driver ({rec.holder()}) has not renewed its lease of run dir {self.run_dir} for "
                      f"{time.time() - rec.renewed_at:.0f} s: it is gone")
        return reason

    def check_commit(self) -> None:
        """Before a checkpoint touches the shared checkpoints dir: LeaseLost unless our generation still owns it."""
        reason = self._foreign(read_lease(self.path))
        if reason is not None:
            raise LeaseLost(f"checkpoint commit refused: {reason}")

