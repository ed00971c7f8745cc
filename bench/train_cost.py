"""Where a CPU-hour of training goes: the default run (launch/configs/tiny.yaml) single-process, and on local Ray
with one and with two DeepSpeed trainers, each launched as a user launches it, one after the other.

    python bench/train_cost.py [--steps 30] [--work-dir runs/train-cost] [--modes single ray1 ray2] [-- OVERRIDES]
    python bench/train_cost.py --steps 2 OVERRIDES...   (a smoke run)

Each launch is sampled every SAMPLE_S from /proc: every process's user + system CPU time, by role (its command line):
  driver   the launch script's own process (single-process: the target forward, packing and the draft step too)
  target   the Ray target worker(s): the target's forward and the features' encoding for the wire
  service  the feature service actor and the cached-batch tasks: batch order, object-store puts
  trainer  the Ray Train workers: receiving and decoding features, packing, the draft's forward/backward, the
           gradients' all-reduce (gloo), the optimizer; DeepSpeed's engine around them
  ray      Ray's own processes: GCS, raylet, dashboard, log monitor, idle workers, the Train controller
and the machine's CPU busy time over the launch (/proc/stat, which is why the bench must run alone). Per step, the
metrics the trainers log split the trainers' time: data_wait_s (rank 0 waiting for its batch), forward_s,
backward_s and optimizer_s (summed over the ranks). Start-up is the wall time from the launch to the first
logged step, less that step; "after the first step" is the machine CPU from the first logged step to the end
(the later steps, the export, the shutdown) over the tokens of those steps. Everything is divided by the trained
tokens (anchor blocks x block positions, `trained_tokens` in the metrics) of the run. Launches start once the
machine is idle again; what no role claims (processes shorter than a sample, CPU after a process's last sample,
other processes on the machine) is printed as "unattributed".

Printed: one table per launch and a comparison; last line:
train_cost cpu_ms_per_token single=A ray1=B ray2=C ratio ray2/single=R ray1/single=Q
(machine CPU milliseconds per trained token over the whole launch, start-up included).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch_helpers import LAUNCH, REPO, TICK, proc_cpu, quiet_env

SAMPLE_S = 0.25
MODES = {"single": ["--single-process"], "ray1": ["cluster.num_trainers=1"], "ray2": ["cluster.num_trainers=2"]}
ROLES = ("driver", "target", "service", "trainer", "ray")


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user, nice, system, irq, softirq: not idle, iowait, or steal (another VM's time on this host)
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / TICK


# Ray's own processes, by the name in their command line (the rest: "other")
RAY_PARTS = ("gcs_server", "raylet", "DashboardAgent", "dashboard", "log_monitor", "runtime_env", "TrainController",
             "TrainStateActor", "AutoscalingCoordinator", "RunControl", "monitor.py", "default_worker.py", "IDLE")


def ray_part(cmd: str) -> str:
    return next((name for name in RAY_PARTS if name in cmd), "other")


def role(pid: int, cmd: str, launch_pid: int) -> str:
    if pid == launch_pid:
        return "driver"
    if "TargetWorker" in cmd or "TargetGroupMember" in cmd:
        return "target"
    if "FeatureService" in cmd or "_read_cached" in cmd:
        return "service"
    if "RayTrainWorker" in cmd:
        return "trainer"
    return "ray"


class Sampler(threading.Thread):
    """Per-role CPU seconds of the processes born after it started (the last value seen for each pid)."""

    def __init__(self, launch_pid: int, metrics: Path):
        super().__init__(daemon=True)
        self.launch_pid, self.metrics = launch_pid, metrics
        self.skip = {int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != launch_pid}
        self.last: dict[int, tuple[float, str]] = {}
        self.first_step_t: float | None = None
        self.first_step_busy: float | None = None  # the machine's CPU busy time then
        self.stop = threading.Event()
        self.own_cpu_s = 0.0

    def run(self) -> None:
        t0 = time.thread_time()
        while not self.stop.wait(SAMPLE_S):
            self.sample()
        self.sample()  # once more after the launch ended: what its last processes used since the previous sample
        self.own_cpu_s = time.thread_time() - t0  # the sampler's own CPU, inside the machine's figure

    def sample(self) -> None:
        for p in os.listdir("/proc"):
            if p.isdigit() and int(p) not in self.skip:
                got = proc_cpu(int(p))
                if got is not None:
                    pid = int(p)
                    # a role is fixed once seen: Ray renames an idle worker when it takes an actor or task
                    name = role(pid, got[1], self.launch_pid)
                    old = self.last.get(pid)
                    if name == "ray":
                        name = f"ray:{ray_part(got[1])}"
                    self.last[pid] = (got[0], old[1] if old is not None and not old[1].startswith("ray") else name)
        if self.first_step_t is None and self.metrics.is_file() and self.metrics.stat().st_size > 0:
            self.first_step_t, self.first_step_busy = time.time(), machine_busy_s()

    def by_role(self) -> dict[str, float]:
        """CPU seconds per role; "ray" also split into "ray:<part>" entries."""
        out = dict.fromkeys(ROLES, 0.0)
        for cpu, name in self.last.values():
            out[name.split(":")[0]] += cpu
            if name.startswith("ray:"):
                out[name] = out.get(name, 0.0) + cpu
        return out


def launch(mode: str, run_dir: Path, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(LAUNCH), "--run-dir", str(run_dir), "--max-steps", str(steps), "--fresh", *MODES[mode],
           "train.log_every=1000", "checkpoint.every_steps=1000", *overrides]  # flags and overrides in any order
    busy0, t0 = machine_busy_s(), time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=quiet_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    sampler = Sampler(proc.pid, run_dir / "metrics.jsonl")
    sampler.start()
    _, err = proc.communicate()
    sampler.stop.set()
    sampler.join()
    wall, busy = time.time() - t0, machine_busy_s() - busy0
    if proc.returncode != 0:
        sys.exit(f"error: {mode} launch failed (exit {proc.returncode}):\n{err[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tokens = sum(r["trained_tokens"] for r in rows)
    phases = {k: sum(r[k] for r in rows) for k in ("step_time_s", "data_wait_s", "forward_s", "backward_s",
                                                  "optimizer_s")}
    if sampler.first_step_t is None:  # the run ended before a sample saw its first step: no split
        startup = steady_cpu = float("nan")
    else:
        startup = sampler.first_step_t - t0 - rows[0]["step_time_s"]
        # after the first step: the steady state (steps 2.., the export and the shutdown)
        steady_cpu = busy0 + busy - sampler.first_step_busy
    return {"mode": mode, "wall_s": wall, "startup_s": startup, "machine_cpu_s": busy, "tokens": tokens,
            "steady_cpu_s": steady_cpu, "steady_tokens": tokens - rows[0]["trained_tokens"],
            "steps": len(rows), "roles": sampler.by_role(), "phases": phases, "sampler_cpu_s": sampler.own_cpu_s}


def settle(timeout_s: float = 60) -> None:
    """Wait until the machine is idle (the previous launch's Ray processes gone): < 0.1 core busy over a second."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        b0 = machine_busy_s()
        time.sleep(1.0)
        if machine_busy_s() - b0 < 0.1:
            return
    print(f"[train_cost] the machine is still busy after {timeout_s:.0f} s: the next figures include that load",
          flush=True)


def table(r: dict) -> str:
    ms = 1000 / r["tokens"]
    lines = [f"{r['mode']}: {r['steps']} steps, {r['tokens']:.0f} trained tokens, wall {r['wall_s']:.0f} s "
             f"(start-up {r['startup_s']:.0f} s), machine CPU {r['machine_cpu_s']:.0f} s = "
             f"{r['machine_cpu_s'] * ms:.1f} ms/token; after the first step "
             f"{r['steady_cpu_s'] * 1000 / max(1, r['steady_tokens']):.1f} ms/token",
             "  CPU by role (ms/token): " + "  ".join(f"{k} {r['roles'][k] * ms:.1f}" for k in ROLES)
             + f"  this sampler {r['sampler_cpu_s'] * ms:.1f}  unattributed "
             f"{(r['machine_cpu_s'] - sum(r['roles'][k] for k in ROLES) - r['sampler_cpu_s']) * ms:.1f}",
             "  trainer phases, wall s over the steps (ms per token): step and data_wait are rank 0's, forward, "
             "backward and optimizer summed over the ranks: " + "  ".join(
                 f"{k.removesuffix('_s')} {v:.1f} ({v * ms:.1f})" for k, v in r["phases"].items())]
    parts = [f"{k[4:]} {v * ms:.1f}" for k, v in sorted(r["roles"].items()) if k.startswith("ray:") and v * ms >= 0.05]
    if parts:
        lines.insert(2, "  of which Ray's own processes: " + "  ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work-dir", default=str(REPO / "runs" / "train-cost"))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("overrides", nargs="*", help="dotted run-config overrides for every launch, e.g. train.lr=3e-4")
    args = p.parse_intermixed_args(argv)  # flags and dotted overrides in any order
    if args.steps < 2:
        sys.exit(f"error: --steps must be at least 2 (the first step's start-up is split from the rest), got "
                 f"{args.steps}")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    results = {}
    for mode in args.modes:
        run_dir = work / mode
        if run_dir.exists():
            shutil.rmtree(run_dir)
        settle()
        print(f"[train_cost] launching {mode} ({args.steps} steps)", flush=True)
        results[mode] = launch(mode, run_dir, args.steps, args.overrides)
        print(table(results[mode]), flush=True)
        (work / "train_cost.json").write_text(json.dumps(results, indent=1))
    per = {m: r["machine_cpu_s"] * 1000 / r["tokens"] for m, r in results.items()}
    base = per.get("single")
    line = "train_cost cpu_ms_per_token " + " ".join(f"{m}={v:.1f}" for m, v in per.items())
    others = [m for m in ("ray2", "ray1") if m in per]
    if base and others:
        line += " ratio " + " ".join(f"{m}/single={per[m] / base:.2f}" for m in others)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
