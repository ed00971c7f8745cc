"""The data path at production scale (issue #21, item 9): launch to first step, peak RSS of the driver and of the
feature service, and time to resume, on synthetic data-stage directories of 10^5 and 10^6 samples.

For each N in --samples it writes a data-stage directory of N rows (random token ids in the data stage's own
layout, written through its own shard writer, pipeline/data/prepare.commit_shard, so the layout cannot drift),
then runs the real launch script on it twice with the tiny random MoE target (bench/launch_helpers.TINY_MOE):
  1. a fresh run of --steps steps (a checkpoint at its last step): the time from launch until metrics.jsonl
     shows step 1, and the peak RSS (VmHWM, sampled from /proc every 0.2 s) of the driver (the launch
     process) and of the FeatureService actor (found among the driver's descendants by its process title);
  2. a resume on the same run dir with --steps more steps: the time from launch until the first new step.
Both launches include Ray's start-up (a local cluster each).

Lengths: log-normal with a median of 256 tokens (sigma 1.0), rounded, clipped to [16, 8192]: mean ~420, p99 ~2600,
about 1 row in 4000 at the 8k cap (~250 of them at 10^6 samples: 4.2e8 tokens, ~0.8 GiB of zstd Parquet). The
first quarter of each row is prompt (loss mask off), the rest is trained. Token ids are uniform in [100, 49152)
(SmolLM2's vocabulary without its added tokens, so the mask-token check passes).

Prints the length distribution and the figures for each N, the largest last:
  data_scale samples=N first_step_s=S driver_peak_rss_gb=D service_peak_rss_gb=V resume_s=R

Run: python bench/data_scale.py --work-dir /root/scale     (10^5 then 10^6 samples; ~15 min on 2 cores)
     python bench/data_scale.py --samples 2000 --steps 2   (the smoke test's size; about 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
from launch_helpers import LAUNCH, REPO, TINY_MOE, logged_steps, quiet_env

from pipeline.data.prepare import commit_shard, finish
from pipeline.data.rows import FORMAT_VERSION, SCHEMA

MEDIAN, SIGMA, MIN_LEN, MAX_LEN = 256, 1.0, 16, 8192
FIRST_ID, VOCAB = 100, 49152


def lengths_for(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(MEDIAN), SIGMA, n)), MIN_LEN, MAX_LEN).astype(np.int64)


def build_data_stage(out: Path, n: int, shard_rows: int, seed: int = 0) -> dict:
    """A finished data-stage directory of n synthetic rows (shards of shard_rows); returns its stats."""
    if (out / "stats.json").is_file():
        stats = json.loads((out / "stats.json").read_text())
        if stats["rows"] == n:
            return stats  # --keep from an earlier run
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    num_shards = -(-n // shard_rows)
    fp = {"format_version": FORMAT_VERSION, "inputs": [{"name": f"synthetic-{n}-seed{seed}"}], "num_records": n,
          "max_len": MAX_LEN, "regenerate": None, "batch_size": None, "shard_size": shard_rows, "target": None}
    state = {"fingerprint": fp, "num_shards": num_shards, "completed": {}, "complete": False}
    rng = np.random.default_rng(seed)
    for s in range(num_shards):
        lo, hi = s * shard_rows, min((s + 1) * shard_rows, n)
        lengths = lengths_for(rng, hi - lo)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = rng.integers(FIRST_ID, VOCAB, int(offsets[-1]), dtype=np.int32)
        row_of = np.repeat(np.arange(hi - lo), lengths)
        mask = (np.arange(int(offsets[-1])) - offsets[:-1][row_of]) >= (lengths // 4)[row_of]
        source = np.arange(lo, hi, dtype=np.int64)
        table = pa.table({
            "row_id": pa.array([f"{i}-1" for i in range(lo, hi)]), "source_index": source,
            "turn_index": pa.array(np.ones(hi - lo, dtype=np.int32)),
            "prompt": pa.array(["[]"] * (hi - lo)), "response": pa.array([""] * (hi - lo)),
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "loss_mask": pa.ListArray.from_arrays(pa.array(offsets), pa.array(mask)),
            "regenerated": pa.array(np.zeros(hi - lo, dtype=bool)), "generation": pa.nulls(hi - lo, pa.string()),
        }, schema=SCHEMA)
        commit_shard(out, state, f"{s:05d}", table, hi - lo, Counter())
    return finish(out, state, MAX_LEN)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _peak_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _is_service(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::FeatureService")
    except OSError:
        return False


class Watch(threading.Thread):
    """Samples the driver's and the feature service's peak RSS and the run's logged step while a launch runs."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, after_step: int) -> None:
        super().__init__(daemon=True)
        self.proc, self.run_dir, self.after_step = proc, run_dir, after_step
        self.t0 = time.time()
        self.first_step_s: float | None = None
        self.driver_kib = self.service_kib = 0
        self.service_pid: int | None = None
        self.phases = ""

    def run(self) -> None:
        alive = None
        while self.proc.poll() is None:
            self.driver_kib = max(self.driver_kib, _peak_kib(self.proc.pid))
            if alive is None or not Path(f"/proc/{alive}").exists():  # not found yet, or restarted, or gone
                alive = next((p for p in _descendants(self.proc.pid) if _is_service(p)), None)
                self.service_pid = alive or self.service_pid
            if alive is not None:
                self.service_kib = max(self.service_kib, _peak_kib(alive))
            if self.first_step_s is None and logged_steps(self.run_dir) > self.after_step:
                self.first_step_s = time.time() - self.t0
            time.sleep(0.2)


def launch(run_dir: Path, data: Path, n: int, max_steps: int, every: int, log_path: Path) -> Watch:
    """Run the launch script once; again (once) if Ray itself timed out starting, which a busy machine causes."""
    try:
        return _launch(run_dir, data, n, max_steps, every, log_path)
    except SystemExit as e:
        if "timed out during startup" not in str(e):
            raise
        print(f"{log_path.name}: the local Ray node timed out starting; launching again", flush=True)
        return _launch(run_dir, data, n, max_steps, every, log_path)


def _launch(run_dir: Path, data: Path, n: int, max_steps: int, every: int, log_path: Path) -> Watch:
    args = ["--run-dir", str(run_dir), "--max-steps", str(max_steps), *TINY_MOE, f"data.source={data}",
            f"data.num_samples={n}", f"data.max_len={MAX_LEN}", f"target.max_tokens_per_forward={MAX_LEN}",
            f"checkpoint.every_steps={every}", "checkpoint.export=false"]
    before = logged_steps(run_dir)
    with open(log_path, "w") as log:
        # this checkout's code, whichever one is installed
        proc = subprocess.Popen([sys.executable, str(LAUNCH), *args], cwd=REPO, env=quiet_env(PYTHONPATH=str(REPO)),
                                stdout=log, stderr=subprocess.STDOUT)
        watch = Watch(proc, run_dir, before)
        watch.start()
        rc = proc.wait()
        watch.join()
    if rc != 0 or watch.first_step_s is None or watch.service_pid is None:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise SystemExit(f"launch on {data} exited {rc} (first step after {watch.first_step_s} s, service pid "
                         f"{watch.service_pid}); log {log_path}:\n{tail}")
    watch.phases = _phases(log_path.read_text(), watch.t0)
    return watch


def _phases(log_text: str, t0: float) -> str:
    """Where the start-up went, from the driver's log lines (second resolution): to its `data:` line (inputs read
    and checked), then to its `training` line (samples file written, Ray, feature service and target started)."""
    import datetime

    day = datetime.datetime.fromtimestamp(t0)
    stamps = {}
    for line in log_text.splitlines():
        for key, marker in (("data", "INFO dspark.launch: data:"), ("training", "INFO dspark.launch: training")):
            if marker in line and key not in stamps:
                hms = datetime.datetime.strptime(line.split()[0], "%H:%M:%S").time()
                stamps[key] = datetime.datetime.combine(day.date(), hms).timestamp()
    if len(stamps) < 2:
        return "phases unknown"
    return (f"inputs {stamps['data'] - t0:.0f} s, then samples file + Ray + service "
            f"{stamps['training'] - stamps['data']:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--work-dir", help="data and run dirs go here (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (and reuse its data on the next run)")
    p.add_argument("--steps", type=int, default=2, help="steps of the fresh run; the resume runs as many more")
    p.add_argument("--shard-rows", type=int, default=4096, help="rows per data-stage shard")
    args = p.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    lines = []
    try:
        for n in sorted(args.samples):
            t = time.time()
            data = work / f"data-{n}"
            stats = build_data_stage(data, n, args.shard_rows)
            lengths = lengths_for(np.random.default_rng(1), min(n, 200_000))  # the same law, for its quantiles
            print(f"N={n}: data stage {data} ({stats['shards']} shards, {stats['tokens']:.3g} tokens, "
                  f"{sum(f.stat().st_size for f in data.glob('*.parquet')) / 2**30:.2f} GiB) in "
                  f"{time.time() - t:.0f} s; lengths log-normal median {MEDIAN} sigma {SIGMA} clipped to "
                  f"[{MIN_LEN}, {MAX_LEN}]: p50 {np.median(lengths):.0f} mean {lengths.mean():.0f} "
                  f"p99 {np.quantile(lengths, 0.99):.0f} at cap {np.mean(lengths == MAX_LEN):.2%}", flush=True)
            run_dir = work / f"run-{n}"
            shutil.rmtree(run_dir, ignore_errors=True)
            fresh = launch(run_dir, data, n, args.steps, args.steps, work / f"run-{n}.fresh.log")
            resumed = launch(run_dir, data, n, 2 * args.steps, args.steps, work / f"run-{n}.resume.log")
            line = (f"data_scale samples={n} first_step_s={fresh.first_step_s:.1f} "
                    f"driver_peak_rss_gb={max(fresh.driver_kib, resumed.driver_kib) / 2**20:.2f} "
                    f"service_peak_rss_gb={max(fresh.service_kib, resumed.service_kib) / 2**20:.2f} "
                    f"resume_s={resumed.first_step_s:.1f}")
            print(f"N={n}: samples file {(run_dir / 'samples.parquet').stat().st_size / 2**30:.2f} GiB; fresh: "
                  f"{fresh.phases}; resume: {resumed.phases}")
            print(f"N={n}: {line}", flush=True)
            lines.append(line)
            shutil.rmtree(run_dir, ignore_errors=True) if not args.keep else None
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))  # the largest N last


if __name__ == "__main__":
    main()
