"""The launch harness of the benchmarks and tests that run the real launch script: a tiny MoE target config, a
loopback Ray head, and a fault schedule. Imported by its own name: bench/ is the folder of a bench script, and
pytest puts bench/ on sys.path (pyproject.toml)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch" / "train_v4_draft.py"

# The tiny preset shrunk onto a tiny random Qwen3-MoE target (hidden 64, SmolLM2 tokenizer): CPU-fast.
TINY_MOE = [
    "target.path=tiny-qwen3-moe", "draft.num_heads=4", "draft.num_kv_heads=2", "draft.head_dim=16",
    "data.num_samples=96", "data.max_len=64", "data.samples_per_batch=4", "train.warmup_steps=2",
    "train.tensorboard=false",
]


def quiet_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", "TQDM_DISABLE": "1",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"})
    env.pop("RAY_ADDRESS", None)
    env.update(extra)
    return env


def run_script(script: str, args: list[str], timeout: float = 600, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess:
    """`python launch/<script> ARGS` from the repository root, as a user runs it (nothing imports launch/)."""
    return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=REPO, env=env or quiet_env(),
                          capture_output=True, text=True, timeout=timeout)


def run_launch(args: list[str], timeout: float = 600, env: dict[str, str] | None = None,
               ) -> subprocess.CompletedProcess:
    return run_script(LAUNCH.name, args, timeout, env)


# An error-level line as Ray's C++ core and Python loggers print it (optionally behind a worker's "(Name pid=N)" tag),
# e.g. "[2026-12-07 03:32:44,393 E 27370 27595] core_worker.cc:2465: ..." or "2026-12-07 ... ERROR worker.py:..."
_ERROR_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,.]+ E \d+ \d+\]"
                         r"|\d{4}-\d\d-\d\d [\d:,.]+\s+ERROR\s|Traceback \(most recent")


def console_errors(output: str) -> list[str]:
    """The lines of a run's console a person would read as a failure: error-level log lines and tracebacks."""
    return [line for line in output.splitlines() if _ERROR_LINE.search(line)]


# Third-party messages known to be harmless in a run, each silenced by its text where it arises (workers/__init__.py,
# workers/driver.connect_ray, workers/trainer/engines.quiet_deepspeed): a console showing one is a regression.
SILENCED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated",
    "Attempting to get learning rate from scheduler before it has started",
    "Token authentication is enabled for this Ray cluster.",
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.",
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully",
)
_STEP_LINE = re.compile(r"\bstep \d+/\d+ \| loss ")
_WORKER_TAG = re.compile(r"^\((?:\w+) pid=\d+(?:, ip=[\d.]+)?\)\s*")


def console_lines(output: str) -> tuple[list[str], list[str]]:
    """(step lines, other lines) of a run's console as a person reads it: colours dropped, a progress bar's redraws
    (carriage returns) each a line, blank lines and Ray's '[repeated Nx across cluster]' notes left out."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", output)
    lines = [re.sub(r"\s*\[repeated \d+x across cluster\].*$", "", ln).rstrip()
             for ln in re.split(r"[\r\n]", text)]
    lines = [ln for ln in lines if _WORKER_TAG.sub("", ln).strip()]
    steps = [ln for ln in lines if _STEP_LINE.search(ln)]
    return steps, [ln for ln in lines if not _STEP_LINE.search(ln)]


def repeated_lines(lines: list[str]) -> dict[str, int]:
    """The lines printed more than once, by their text after any '(Worker pid=N)' tag."""
    from collections import Counter

    counts = Counter(_WORKER_TAG.sub("", ln) for ln in lines)
    return {ln: n for ln, n in counts.items() if n > 1}


# The ray CLI of the interpreter running this file: `ray` from PATH may be another install's, or missing when a
# venv's python is run without activating the venv (`venv/bin/python bench/faults.py`).
RAY_CLI = [sys.executable, "-m", "ray.scripts.scripts"]


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's children that were waited for (a subprocess.run, a Popen's
    wait): what a bench charges a training run or a data stage."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[int, float, int] | None:
    """(parent pid, user + system CPU seconds of all its threads, start time in clock ticks after boot) of a live
    process; the start time tells a reused pid from the process that had it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": fields 3, 4, ...
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK, int(rest[19])


def proc_cpu(pid: int) -> tuple[float, str] | None:
    """(user + system CPU seconds of all its threads, command line) of a live process."""
    got = _proc_stat(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return (got[1], cmd) if got is not None else None


class DescendantCPU(threading.Thread):
    """CPU seconds of this process's descendants, sampled from /proc every `period` s (the last value seen per
    process), for what `children_cpu_s` misses: the CPU of a process whose parent does not wait for it. Ray's
    raylet is such a parent: the CPU of the target workers of a `prepare_data.py --ray` stage never reached the
    bench that waited for the CLI (a 2-worker stage of an hour was charged 92 CPU seconds). A process once seen
    is followed after its parent ends; what a process spends after the last sample before it ends is missed (at
    most `period` s each). Use as a context manager; `cpu_s` is the total once it exits."""

    def __init__(self, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.period, self.root = period, os.getpid()
        self.last: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds when last seen
        self.halt = threading.Event()
        self.cpu_s = 0.0

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.sample()

    def sample(self) -> None:
        stats = {int(p): got for p in os.listdir("/proc") if p.isdigit() and (got := _proc_stat(int(p)))}
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            kids.setdefault(ppid, []).append(pid)
        # this process's tree, and the processes seen in it before that have since been re-parented
        todo = [self.root] + [pid for pid, start in self.last if pid in stats and stats[pid][2] == start]
        mine: set[int] = set()
        while todo:
            pid = todo.pop()
            if pid not in mine:
                mine.add(pid)
                todo += kids.get(pid, [])
        for pid in mine - {self.root}:
            self.last[(pid, stats[pid][2])] = stats[pid][1]

    def __enter__(self) -> DescendantCPU:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.join()
        self.sample()
        self.cpu_s = sum(self.last.values())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackHead:
    """`ray start --head --block` on 127.0.0.1 (this interpreter's Ray: RAY_CLI), held by its own process handle;
    `stop()` ends what it started."""

    def __init__(self, num_cpus: int = 4, dashboard: bool = False) -> None:
        self.port = free_port()
        self.dashboard_port = free_port()
        self.temp_dir = Path(f"/tmp/ray-test-{self.port}")
        cmd = [*RAY_CLI, "start", "--head", "--block", f"--port={self.port}", "--node-ip-address=127.0.0.1",
               f"--num-cpus={num_cpus}", f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        if dashboard:
            # the job agent's HTTP port too: its default (52365) is taken by any other Ray cluster on the machine
            cmd += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                    f"--dashboard-agent-listen-port={free_port()}"]
        else:
            cmd += ["--include-dashboard=false"]
        self.env = quiet_env(PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.address = f"127.0.0.1:{self.port}"
        self._wait_ready(dashboard)

    def _wait_ready(self, dashboard: bool, timeout: float = 90) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {self.proc.stdout.read()}")
            probe = subprocess.run([*RAY_CLI, "status", f"--address={self.address}"], env=self.env,
                                   capture_output=True, text=True)
            if probe.returncode == 0 and (not dashboard or _port_open(self.dashboard_port)):
                return
            time.sleep(1)
        self.stop()
        raise TimeoutError("ray head did not come up")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Every process of this head (GCS, raylet, dashboard, workers) is in the process group `ray start` leads
            # (start_new_session above). SIGTERM to the whole group stops them side by side; terminating only
            # `ray start --block` makes it stop them one by one, each with its own grace period (half a minute).
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # `ray start` wrote this head's address to /tmp/ray/ray_current_cluster, where Ray's address "auto" looks
        # first; left behind, it sends later local clusters' Ray Train placement-group cleaner to a dead GCS (a
        # traceback mid-run). Remove it if it still names this head.
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip() == self.address:
            current.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the whole group has exited
        pass


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def actor_pids(head: LoopbackHead, class_name: str) -> list[int]:
    """PIDs of the live actors of `class_name` on the head's cluster (Ray's state API, through its dashboard)."""
    from ray.util.state import list_actors

    actors = list_actors(address=f"http://127.0.0.1:{head.dashboard_port}", detail=True,
                         filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])
    return sorted(int(a.pid) for a in actors if a.pid)


def logged_steps(run_dir: Path) -> int:
    """The highest step in the run's metrics.jsonl so far (0 before the first)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            step = max(step, int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass  # a line being written
    return step


def committed_checkpoints(run_dir: Path) -> tuple[str, list[str]]:
    """The checkpoints dir's committed state: `latest` and the step dirs (a fenced save may leave a .tmp). Shared by
    tests/test_faults.py's killed-driver test and bench/abuse.py, which judge orphan commits by it."""
    root = Path(run_dir) / "checkpoints"
    return ((root / "latest").read_text().strip(),
            sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and not p.name.endswith(".tmp")))


class FaultSchedule:
    """Runs the launch script in the background and injects faults when metrics.jsonl reaches given steps:
    ("kill", class_name) SIGKILLs one live actor of that class (a crash; if none is alive, because Ray is still
    restarting the one killed before, as soon as one is), ("sigterm", None) sends SIGTERM to the launch process
    (a preemption notice). Returns the launch's exit status and when each fault fired."""

    def __init__(self, head: LoopbackHead, args: list[str], run_dir: Path,
                 faults: list[tuple[int, str, str | None]]) -> None:
        self.head, self.args, self.run_dir, self.faults = head, args, Path(run_dir), sorted(faults)

    def run(self, timeout: float = 900) -> tuple[int, list[tuple[int, str, str | None, int]], str]:
        import signal as _signal

        env = quiet_env(RAY_ADDRESS=self.head.address)
        log = open(self.run_dir.parent / f"{self.run_dir.name}.log", "w")
        proc = subprocess.Popen([sys.executable, str(LAUNCH), *self.args], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        fired: list[tuple[int, str, str | None, int]] = []
        pending = list(self.faults)
        waiting_since = None  # when the next kill found no live actor of its class
        deadline = time.time() + timeout
        try:
            while proc.poll() is None and time.time() < deadline:
                step = logged_steps(self.run_dir)
                while pending and step >= pending[0][0]:
                    at, kind, cls = pending[0]
                    if kind == "sigterm":
                        proc.send_signal(_signal.SIGTERM)
                        fired.append((at, kind, cls, proc.pid))
                    else:
                        pids = actor_pids(self.head, cls)
                        if not pids:  # the one killed before may still be restarting (a busy machine): kill
                            waiting_since = waiting_since or time.time()  # when one is alive again, but
                            assert time.time() - waiting_since < 120, f"no live {cls} actor to kill at step {step}"
                            break
                        waiting_since = None
                        os.kill(pids[-1], _signal.SIGKILL)
                        fired.append((at, kind, cls, pids[-1]))
                    pending.pop(0)
                time.sleep(0.2)
            if proc.poll() is None:
                proc.kill()
                raise TimeoutError(f"launch did not finish within {timeout} s")
        finally:
            log.close()
        return proc.returncode, fired, (self.run_dir.parent / f"{self.run_dir.name}.log").read_text()
