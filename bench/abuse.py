"""Abuse matrix (issues #21, #47): bad config values and files, bad data files (compressed ones too), damaged target
directories and hostile run-dir situations, each through the real launch script (launch/train_v4_draft.py, tiny
random MoE target), each with the exit status it must give and the key or file its one line must name.

    PYTHONPATH=. python bench/abuse.py --quick       # the 38 cases that end before Ray starts: 8-15 minutes
    PYTHONPATH=. python bench/abuse.py               # + the Ray cases on a loopback head: 20-30 minutes on 2 cores
    PYTHONPATH=. python bench/abuse.py --only data   # one family: config, data, target, rundir (--case NAME: one)

One line per case (`name | exit E (want W) | clean yes/no | why`), then, last:
abuse cases=N clean=C exit2=E tracebacks=T retried=R orphan_commits=O

- clean: the expected exit status, no traceback, and exactly one `error: ` line naming the key or file (for a
  checkpoint that must fall back: no `error: ` line, one `is unusable` line naming the file, the run finishing);
  where the case says so, also nothing left behind (no run dir made) or the first driver undisturbed.
- tracebacks: `Traceback (most recent call last)` occurrences in the output of every launch of every case.
- retried: a case whose trainer group Ray Train started more than once ('Started training worker group'): a
  failure a restart would only repeat (the full disk) ends the group without a retry
  (workers/trainer/ray_trainer.train_loop; tests/test_faults.py asserts exactly that), so a second start is a
  failure re-run that cannot succeed.
- orphan_commits: in the killed-driver case, step dirs (or `latest`) of the checkpoints dir that appeared or changed
  between the new driver's takeover (lease generation 2) and its own trainers' start ('resumed from'): only the
  old driver's trainers can have written them (judged as tests/test_faults.py's killed-driver test does, by
  launch_helpers.committed_checkpoints, plus each step dir's inode and mtime so a dir replaced under the same name
  counts).
- skipped cases (a read-only or a full disk needs a tmpfs mount: root) are listed and not counted in N.
- --quick leaves out the Ray-launching cases (second driver, killed driver, full disk, corrupt checkpoints).

A case that should end before Ray starts runs with RAY_ADDRESS pointing at a closed port, so a bad value that
slips through fails fast (as an unclean exit 1) instead of training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launch_helpers import (
    LAUNCH,
    REPO,
    TINY_MOE,
    LoopbackHead,
    committed_checkpoints,
    free_port,
    logged_steps,
    quiet_env,
    run_launch,
)

TRACEBACK = "Traceback (most recent call last)"
GROUP_STARTED = "Started training worker group"
NO_RAY = {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"}  # nothing listens there: a case that gets to Ray fails fast
RAY_ARGS = [*TINY_MOE, "checkpoint.export=false", "cluster.max_failures=2"]


@dataclass
class Outcome:
    exit: int | None  # None: timed out
    output: str  # stdout + stderr of the launch(es) judged
    why: list[str] = field(default_factory=list)  # what else is wrong, found by the case itself
    tracebacks: int = 0
    starts: int = 0  # 'Started training worker group' in the judged launch
    orphans: int = 0
    skipped: str = ""


@dataclass
class Case:
    family: str  # config | data | target | rundir
    name: str
    want_exit: int
    needle: str  # what the one line must contain (the key or the file); {run_dir} and {work} are filled in
    run: Callable[[Path], Outcome]  # given the case's own work dir
    ray: bool = False
    fallback: bool = False  # the line is a warning ('is unusable') and the run finishes


def error_lines(text: str) -> list[str]:
    """The `error: ` lines (a worker's unfinished log line may precede one on its line)."""
    out = []
    for ln in text.splitlines():
        if ln.startswith("error: "):
            out.append(ln)
        elif "error: training failed: " in ln:
            out.append(ln[ln.find("error: training failed: "):])
    return out


def classify(case: Case, o: Outcome, needle: str) -> list[str]:
    why = list(o.why)
    if o.exit is None:
        return why or ["timed out"]
    if o.exit != case.want_exit:
        why.insert(0, f"exit {o.exit}")
    if o.tracebacks:
        why.append(f"{o.tracebacks} traceback(s)")
    text = re.sub(r"\x1b\[[0-9;]*m", "", o.output)  # Ray colours the '(RayTrainWorker pid=…)' prefixes
    errors = error_lines(text)
    if case.fallback:
        if errors:
            why.append(f"error line: {errors[-1][:300]}")
        # the driver's own lines: rank 0 of the trainers verifies again (by design, docs/fault-tolerance.md) and
        # repeats the warning under its '(RayTrainWorker pid=…)' prefix; the repeat is counted, not judged
        unusable = [ln for ln in text.splitlines() if "is unusable" in ln and not ln.startswith("(")]
        if len(unusable) != 1 or needle not in unusable[0]:
            why.append(f"{len(unusable)} 'is unusable' line(s) from the driver, want one naming {needle}")
    elif case.want_exit != 0:
        if len(errors) != 1:
            why.append(f"{len(errors)} error lines" + (f", last: {errors[-1][:300]}" if errors else ""))
        elif needle not in errors[0]:
            why.append(f"the line does not name {needle}: {errors[0][:300]}")
    if o.starts > 1:
        why.append(f"trainer group started {o.starts} times")
    if o.orphans:
        why.append(f"{o.orphans} orphan commit(s)")
    return why


# --- launches ---------------------------------------------------------------------------------------------------

def quick_launch(args: list[str], timeout: float = 180) -> Outcome:
    try:
        res = run_launch(args, timeout=timeout, env=quiet_env(**NO_RAY))
    except subprocess.TimeoutExpired as e:
        return Outcome(None, str(e.stdout or "") + str(e.stderr or ""))
    out = res.stdout + res.stderr
    return Outcome(res.returncode, out, tracebacks=out.count(TRACEBACK), starts=out.count(GROUP_STARTED))


class Background:
    """The launch script in the background on a loopback head; stdout+stderr to `log`."""

    def __init__(self, head: LoopbackHead, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, str(LAUNCH), *args], cwd=REPO, stdout=f,
                                         stderr=subprocess.STDOUT, env=quiet_env(RAY_ADDRESS=head.address))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 600) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_for(cond: Callable[[], bool], timeout: float = 600, poll: float = 0.2) -> bool:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            return False
        time.sleep(poll)
    return True


def ray_outcome(rc: int | None, *logs: str, why: list[str] | None = None) -> Outcome:
    judged = logs[-1]
    return Outcome(rc, judged, why or [], tracebacks=sum(t.count(TRACEBACK) for t in logs),
                   starts=judged.count(GROUP_STARTED))


# --- the cases --------------------------------------------------------------------------------------------------

def config_case(override: str, key: str) -> Case:
    def run(d: Path) -> Outcome:
        o = quick_launch(["--run-dir", str(d / "run"), *TINY_MOE, override])
        if (d / "run").exists():
            o.why.append("the run dir was made")
        return o

    return Case("config", override, 2, key, run)


CONFIG = [
    config_case("draft.num_kv_heads=0", "draft.num_kv_heads"),
    config_case("draft.num_heads=0", "draft.num_heads"),
    config_case("draft.num_layers=0", "draft.num_layers"),
    config_case("train.betas=[2,3]", "train.betas"),
    config_case("data.seed=-1", "data.seed"),
    config_case("train.grad_clip=-1", "train.grad_clip"),
    config_case("checkpoint.keep_last=0", "checkpoint.keep_last"),
    config_case("target.max_tokens_per_forward=0", "target.max_tokens_per_forward"),
    # 0 CPUs per trainer is a valid value (a GPU trainer that needs no CPU reservation): -1 is the bad one
    config_case("cluster.cpus_per_trainer=-1", "cluster.cpus_per_trainer"),
    config_case("train.learning_rate=1e-3", "learning_rate"),  # an unknown key
    config_case("train.max_steps=ten", "train.max_steps"),  # a wrong type
    config_case("draft.arch=nope", "draft.arch"),
]


def config_file_case(name: str, text: bytes) -> Case:
    """A config file the user wrote, broken as YAML: one line naming the file."""
    def run(d: Path) -> Outcome:
        (d / "run.yaml").write_bytes(text)
        o = quick_launch(["--run-dir", str(d / "run"), "--config", str(d / "run.yaml"), *TINY_MOE])
        if (d / "run").exists():
            o.why.append("the run dir was made")
        return o

    return Case("config", name, 2, "{work}/run.yaml", run)


CONFIG += [
    config_file_case("config file: unclosed list", b"train:\n  lr: [1,\n"),
    config_file_case("config file: a tab", b"train:\n\tlr: 1\n"),
    config_file_case("config file: a section twice", b"train:\n  lr: 1\ntrain:\n  max_steps: 2\n"),
    config_file_case("config file: two documents", b"train: {}\n---\ndata: {}\n"),
    config_file_case("config file: not UTF-8", b"train: {} # caf\xe9\n"),
]


def _jsonl(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def _parquet(path: Path, **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


GOOD = json.dumps({"text": "def add(a, b):\n    return a + b\n" * 4})


def data_case(name: str, make: Callable[[Path], Path]) -> Case:
    def run(d: Path) -> Outcome:
        path = make(d)
        o = quick_launch(["--run-dir", str(d / "run"), *TINY_MOE, f"data.source={path}"])
        if (d / "run").exists():
            o.why.append("the run dir was left behind")
        return o

    return Case("data", name, 2, "{data}", run)


DATA = [
    data_case("invalid JSON line", lambda d: _jsonl(d / "broken.jsonl", GOOD, '{"text": "unfinished')),
    data_case("plain text", lambda d: _jsonl(d / "notes.txt", "just some notes", "more notes")),
    data_case("not UTF-8", lambda d: _jsonl(d / "latin1.jsonl", GOOD, '{"text": "caf\u00e9"}'.encode("latin-1"))),
    data_case("Parquet with wrong columns", lambda d: _parquet(d / "other.parquet", tokens=[[1, 2, 3]], text=["a"])),
    data_case("Parquet input_ids not a list", lambda d: _parquet(d / "flat.parquet", input_ids=[1, 2, 3],
                                                                 loss_mask=[[True], [True], [True]])),
    data_case("missing file", lambda d: d / "nowhere.jsonl"),
    data_case("empty file", lambda d: _jsonl(d / "empty.jsonl")),
]


def _zst(path: Path, *lines: str, cut: int | None = None) -> Path:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress("".join(x + "\n" for x in lines).encode())[:cut])
    return path


DATA += [
    data_case("truncated .jsonl.zst", lambda d: _zst(d / "cut.jsonl.zst", *[GOOD] * 50, cut=40)),
    data_case(".jsonl.gz that is not gzip", lambda d: _jsonl(d / "plain.jsonl.gz", GOOD)),
    data_case("bad line in a .jsonl.zst", lambda d: _zst(d / "broken.jsonl.zst", GOOD, '{"text": "unfinished')),
]
DATA_FILES = {"invalid JSON line": "broken.jsonl", "plain text": "notes.txt", "not UTF-8": "latin1.jsonl",
              "Parquet with wrong columns": "other.parquet", "Parquet input_ids not a list": "flat.parquet",
              "missing file": "nowhere.jsonl", "empty file": "empty.jsonl", "truncated .jsonl.zst": "cut.jsonl.zst",
              ".jsonl.gz that is not gzip": "plain.jsonl.gz", "bad line in a .jsonl.zst": "broken.jsonl.zst"}


# a damaged target directory: a copy of the tiny MoE target with one file broken

def target_case(name: str, file: str, damage: Callable[[Path], None]) -> Case:
    def run(d: Path) -> Outcome:
        from workers.frozen_target.model import resolve_target_path

        shutil.copytree(resolve_target_path("tiny-qwen3-moe"), d / "target")
        damage(d / "target")
        o = quick_launch(["--run-dir", str(d / "run"), *TINY_MOE, f"target.path={d / 'target'}"])
        if (d / "run").exists():
            o.why.append("the run dir was left behind")
        return o

    return Case("target", name, 2, "{work}/target" + (f"/{file}" if file else ""), run)


def _cut(name: str, keep: int) -> Callable[[Path], None]:
    return lambda t: (t / name).write_bytes((t / name).read_bytes()[:keep])


def _config_json(**changes) -> Callable[[Path], None]:
    def damage(t: Path) -> None:
        (t / "config.json").write_text(json.dumps({**json.loads((t / "config.json").read_text()), **changes}))
    return damage


TARGET = [
    target_case("config.json cut short", "config.json", _cut("config.json", 40)),
    target_case("config.json of an unknown model_type", "config.json", _config_json(model_type="nope")),
    target_case("more layers in config.json than weights", "", _config_json(num_hidden_layers=5)),
    target_case("other attention heads than the weights", "model.safetensors", _config_json(num_attention_heads=8)),
    target_case("weights cut short", "model.safetensors", _cut("model.safetensors", 5000)),
    target_case("tokenizer.json cut short", "tokenizer.json", _cut("tokenizer.json", 100)),
    target_case("chat template that does not compile", "chat_template.jinja",
                lambda t: (t / "chat_template.jinja").write_text("{% for m in %}")),
]


# hostile run dirs without Ray

def _mount_tmpfs(mnt: Path, size: str) -> str:
    """'' when mounted, else why not."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    mnt.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    return "" if res.returncode == 0 else f"mount failed: {res.stderr.strip()}"


def _umount(mnt: Path) -> None:
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _read_only(d: Path, make_child: bool) -> tuple[Path, str, Callable[[], None]]:
    """A dir on a read-only file system (root: a tmpfs remounted read-only) or, not root, a chmod 555 dir.
    Returns (the run dir to use, why skipped, cleanup)."""
    ro = d / "ro"
    if os.geteuid() != 0:
        ro.mkdir()
        if make_child:
            (ro / "run").mkdir()
        target = ro / "run" if make_child else ro
        target.chmod(0o555)
        return ro / "run", "", lambda: target.chmod(0o755)
    why = _mount_tmpfs(ro, "1m")
    if why:
        return ro / "run", why, lambda: None
    if make_child:
        (ro / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    return ro / "run", "", lambda: _umount(ro)


def _ro_case(make_child: bool) -> Callable[[Path], Outcome]:
    def run(d: Path) -> Outcome:
        run_dir, why, cleanup = _read_only(d, make_child)
        if why:
            return Outcome(None, "", skipped=why)
        try:
            return quick_launch(["--run-dir", str(run_dir), *TINY_MOE])
        finally:
            cleanup()

    return run


def _file_case(d: Path) -> Outcome:
    (d / "run").write_text("not a dir")
    return quick_launch(["--run-dir", str(d / "run"), *TINY_MOE])


def _truncated_lease(d: Path) -> Outcome:
    from workers.lease import LEASE_FILE, Lease

    (d / "run").mkdir()  # a run dir the lease made and nothing used goes on release
    lease = Lease.acquire(d / "run", heartbeat=False)
    lease.release()
    path = d / "run" / LEASE_FILE
    path.write_bytes(path.read_bytes()[:40])
    return quick_launch(["--run-dir", str(d / "run"), *TINY_MOE])


RUNDIR_QUICK = [
    Case("rundir", "run dir is a file", 2, "{work}/run", _file_case),
    Case("rundir", "read-only run dir", 2, "{work}/ro/run", _ro_case(make_child=True)),
    Case("rundir", "unwritable parent", 2, "{work}/ro/run", _ro_case(make_child=False)),
    Case("rundir", "truncated lease.json", 2, "{work}/run/lease.json", _truncated_lease),
]


# hostile run dirs with Ray (one loopback head for all)

class RayCases:
    def __init__(self) -> None:
        self._head: LoopbackHead | None = None
        self.base: Path | None = None  # a stopped run with two checkpoints: the corrupt-checkpoint cases copy it

    @property
    def head(self) -> LoopbackHead:
        if self._head is None:
            # with its dashboard, as tests/test_faults.py's: Ray Train's placement-group cleaner polls the state API
            self._head = LoopbackHead(num_cpus=4, dashboard=True)
        return self._head

    def stop(self) -> None:
        if self._head is not None:
            self._head.stop()

    def second_driver(self, d: Path) -> Outcome:
        """A second driver on a live run: exit 2 at once, naming the first; the first trains on to its SIGTERM."""
        run_dir = d / "run"
        first = Background(self.head, ["--run-dir", str(run_dir), "--max-steps", "1000", *RAY_ARGS,
                                       "checkpoint.every_steps=2"], d / "first.log")
        why: list[str] = []
        try:
            if not wait_for(lambda: logged_steps(run_dir) >= 3 or first.proc.poll() is not None):
                return Outcome(None, first.text(), ["the first run never reached step 3"])
            if first.proc.poll() is not None:
                return Outcome(first.proc.returncode, first.text(), ["the first run ended before step 3"])
            kept = {n: (run_dir / n).stat().st_mtime_ns for n in ("samples.parquet", "config.yaml")}
            t0 = time.time()
            second = run_launch(["--run-dir", str(run_dir), "--max-steps", "1000", *RAY_ARGS],
                                env=quiet_env(RAY_ADDRESS=self.head.address), timeout=300)
            took = time.time() - t0
            if took > 60:
                why.append(f"refused after {took:.0f} s")
            if {n: (run_dir / n).stat().st_mtime_ns for n in kept} != kept:
                why.append("the second driver rewrote samples.parquet or config.yaml")
            if len(second.stderr.strip().splitlines()) != 1:
                why.append(f"{len(second.stderr.strip().splitlines())} stderr lines")
            if first.proc.poll() is not None:
                why.append(f"the first run ended ({first.proc.returncode}) when the second was refused")
            first.proc.send_signal(signal.SIGTERM)
            rc_first = first.wait()
            if rc_first != 75:
                why.append(f"the first run then exited {rc_first}, not 75 after SIGTERM")
            elif len(committed_checkpoints(run_dir)[1]) >= 2:
                self.base = run_dir
        finally:
            first.kill()
        out = second.stdout + second.stderr
        return Outcome(second.returncode, out, why, tracebacks=out.count(TRACEBACK) + first.text().count(TRACEBACK),
                       starts=first.text().count(GROUP_STARTED))  # the second never starts one

    def killed_driver(self, d: Path) -> Outcome:
        """kill -9 of a driver checkpointing every step, then the same command at once: the new driver takes over,
        the old one's trainers commit nothing after that; the new run resumes and finishes (exit 0)."""
        from workers.lease import LEASE_FILE, read_lease

        run_dir = d / "run"
        args = ["--run-dir", str(run_dir), *RAY_ARGS]
        first = Background(self.head, ["--max-steps", "1000", *args, "checkpoint.every_steps=1"], d / "first.log")
        try:
            if not wait_for(lambda: logged_steps(run_dir) >= 3 or first.proc.poll() is not None):
                return Outcome(None, first.text(), ["the first run never reached step 3"])
            if first.proc.poll() is not None:
                return Outcome(None, first.text(), [f"the first run ended ({first.proc.returncode}) before step 3"])
        finally:
            first.kill()
        killed_at = logged_steps(run_dir)
        # the old trainers may commit a step or two before the takeover: leave the new run steps to train
        second = Background(self.head, ["--max-steps", str(killed_at + 5), *args], d / "second.log")
        why: list[str] = []

        def snapshot() -> tuple[str, dict[str, tuple[int, int]]]:
            latest, names = committed_checkpoints(run_dir)
            stats = {}
            for n in names:
                try:
                    st = (run_dir / "checkpoints" / n).stat()
                    stats[n] = (st.st_ino, st.st_mtime_ns)
                except FileNotFoundError:
                    pass
            return latest, stats

        def generation() -> int:
            try:
                rec = read_lease(run_dir / LEASE_FILE)
            except Exception:
                return 0
            return rec.generation if rec else 0

        try:
            if not wait_for(lambda: generation() >= 2 or second.proc.poll() is not None, timeout=120, poll=0.02):
                return ray_outcome(None, first.text(), second.text(), why=["no takeover within 120 s"])
            t_takeover = time.time()
            at_takeover = snapshot()
            wait_for(lambda: "resumed from" in second.text() or second.proc.poll() is not None)
            at_resume = snapshot()
            rc = second.wait()
        finally:
            second.kill()
        orphans = sorted(n for n, st in at_resume[1].items() if at_takeover[1].get(n) != st)
        orphans += sorted(n for n in at_takeover[1] if n not in at_resume[1])  # a committed dir removed
        if at_resume[0] != at_takeover[0] and not orphans:
            orphans.append("latest")
        text = second.text()
        if f"took over run dir {run_dir}" not in text:
            why.append("no 'took over run dir' line")
        if orphans:
            why.append(f"committed after the takeover ({time.time() - t_takeover:.0f} s ago): {orphans}")
        o = ray_outcome(rc, first.text(), text, why=why)
        o.orphans = len(orphans)
        return o

    def full_disk(self, d: Path) -> Outcome:
        """A 256 MiB tmpfs filled after the step-4 checkpoint: the step-8 save fails: one line, exit 1, once."""
        mnt = d / "small"
        why = _mount_tmpfs(mnt, "256m")
        if why:
            return Outcome(None, "", skipped=why)
        try:
            run_dir = mnt / "run"
            proc = Background(self.head, ["--run-dir", str(run_dir), "--max-steps", "12", *RAY_ARGS,
                                          "checkpoint.every_steps=4"], d / "run.log")  # the log off the small disk
            try:
                wait_for(lambda: logged_steps(run_dir) >= 5 or proc.proc.poll() is not None)
                st = os.statvfs(mnt)
                with open(mnt / "filler", "wb") as f:  # leave 256 KiB: the metrics rows fit, a checkpoint does not
                    for _ in range((st.f_bavail * st.f_frsize - (256 << 10)) >> 20):
                        f.write(b"\0" * (1 << 20))
                rc = proc.wait()
            finally:
                proc.kill()
            why_not = []
            if list((run_dir / "checkpoints").glob("*.tmp")):
                why_not.append("a .tmp dir was left")
            if (run_dir / "checkpoints" / "latest").is_file() and committed_checkpoints(run_dir)[0] != "step_00000004":
                why_not.append(f"latest is {committed_checkpoints(run_dir)[0]}, not step_00000004")
            return ray_outcome(rc, proc.text(), why=why_not)
        finally:
            _umount(mnt)

    def _base(self, d: Path) -> Path:
        if self.base is None:  # the second-driver case did not leave one: make one (4 steps, checkpoints 2 and 4)
            res = run_launch(["--run-dir", str(d / "base"), "--max-steps", "4", *RAY_ARGS, "checkpoint.every_steps=2"],
                             env=quiet_env(RAY_ADDRESS=self.head.address))
            if res.returncode != 0:
                raise RuntimeError(f"could not make a run with checkpoints: {res.stderr[-2000:]}")
            self.base = d / "base"
        return self.base

    def corrupt(self, name: str, data: bytes) -> Callable[[Path], Outcome]:
        """The newest checkpoint's `name` replaced and the checkpoint sealed again (the manifest matches, the
        content is bad), then the same command: one 'is unusable' line, a fallback, the run finishes."""
        def run(d: Path) -> Outcome:
            from workers.trainer.checkpoint import MANIFEST, write_manifest

            run_dir = d / "run"
            shutil.copytree(self._base(d), run_dir)
            latest, names = committed_checkpoints(run_dir)
            ckpt = run_dir / "checkpoints" / latest
            (ckpt / name).write_bytes(data)
            (ckpt / MANIFEST).unlink()
            write_manifest(ckpt)
            step = int(latest.split("_")[1])
            res = run_launch(["--run-dir", str(run_dir), "--max-steps", str(step + 1), *RAY_ARGS],
                             env=quiet_env(RAY_ADDRESS=self.head.address))
            out = res.stdout + res.stderr
            why = [] if "the newest checkpoint that verifies" in out else ["no 'using step_…' line"]
            return ray_outcome(res.returncode, out, why=why)

        return run


def ray_cases(rc: RayCases) -> list[Case]:
    return [
        Case("rundir", "second driver on a live run", 2, "is in use by pid", rc.second_driver, ray=True),
        Case("rundir", "driver SIGKILLed, new driver at once", 0, "", rc.killed_driver, ray=True),
        Case("rundir", "full disk during a save", 1, "the disk is full (ENOSPC)", rc.full_disk, ray=True),
        Case("rundir", "corrupt meta.json in the latest checkpoint", 0, "meta.json does not parse",
             rc.corrupt("meta.json", b'{"step": 6, "config'), ray=True, fallback=True),
        Case("rundir", "bad ledger.parquet in the latest checkpoint", 0, "ledger.parquet does not read",
             rc.corrupt("ledger.parquet", b"PAR1" + b"x" * 100), ray=True, fallback=True),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["config", "data", "target", "rundir"], help="one family of cases")
    p.add_argument("--quick", action="store_true", help="leave out the Ray-launching cases")
    p.add_argument("--case", help="only the cases whose name contains this")
    p.add_argument("--work-dir", default="runs/bench-abuse", help="each case's files go here (replaced)")
    a = p.parse_args()

    work = Path(a.work_dir).resolve()
    if work.exists():
        subprocess.run(["umount", "-l", *map(str, work.glob("*/ro")), *map(str, work.glob("*/small"))],
                       capture_output=True)  # a mount left by an interrupted run
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rc = RayCases()
    cases = CONFIG + DATA + TARGET + RUNDIR_QUICK + ([] if a.quick else ray_cases(rc))
    cases = [c for c in cases if a.only in (None, c.family) and (a.case or "") in c.name]

    n = clean = exit2 = tracebacks = retried = orphans = 0
    skipped = []
    try:
        for i, case in enumerate(cases):
            d = work / f"{i:02d}-{re.sub(r'[^a-z0-9]+', '-', case.name.lower()).strip('-')[:40]}"
            d.mkdir()
            t0 = time.time()
            try:
                o = case.run(d)
            except Exception as e:  # the bench's own failure: reported as the case's, the matrix goes on
                o = Outcome(None, traceback.format_exc(), [f"bench error: {type(e).__name__}: {e}"])
            if o.skipped:
                skipped.append(case.name)
                print(f"{case.name} | skipped: {o.skipped}", flush=True)
                continue
            (d / "output.log").write_text(o.output)
            needle = case.needle.format(work=d, data=d / DATA_FILES.get(case.name, ""))
            why = classify(case, o, needle)
            n += 1
            clean += not why
            exit2 += o.exit == 2
            tracebacks += o.tracebacks
            retried += o.starts > 1
            orphans += o.orphans
            note = f" | trainer group started {o.starts}x" if case.ray else ""
            if case.fallback:
                note += f" | 'is unusable' lines in all {sum('is unusable' in ln for ln in o.output.splitlines())}"
            print(f"{case.name} | exit {o.exit} (want {case.want_exit}) | clean {'no' if why else 'yes'}"
                  f"{' | ' + '; '.join(why) if why else ''}{note} | {time.time() - t0:.0f} s", flush=True)
    finally:
        rc.stop()
    if skipped:
        print(f"skipped {len(skipped)}: {', '.join(skipped)}")
    print(f"abuse cases={n} clean={clean} exit2={exit2} tracebacks={tracebacks} retried={retried} "
          f"orphan_commits={orphans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
