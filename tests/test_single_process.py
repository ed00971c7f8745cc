"""`launch/train_v4_draft.py --single-process` (workers/trainer/single_process.py) trains a draft end to end on a
machine where neither Ray nor DeepSpeed can be imported (as on a lent accelerator), and its export loads back onto the
target; a run killed after a checkpoint and started again resumes with the losses of an uninterrupted run; bad
input is one `error:` line, exit status 2. The serving baselines (mtp1, draft-lm) train a few steps through the
same trainer, in this process.
Step-for-step equality of its engine with DeepSpeed's is tests/test_trainer_step.py; of its loss curve with the
Ray trainers', tests/test_pipeline_e2e.py.

Run: python -m pytest tests/test_single_process.py -q     (about 25 s on 2 cores; -m slow adds the end-to-end run
     and the killed run, about a minute)
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import pytest
from launch_helpers import LAUNCH, REPO, TINY_MOE, logged_steps, quiet_env

from pipeline.metrics import read_jsonl_metrics

# the launch script, run as __main__ in a process where `import ray` and `import deepspeed` raise ImportError, as
# where they are not installed
SCRIPT = """
import runpy, sys
sys.modules["ray"] = None
sys.modules["deepspeed"] = None
sys.argv = [{launch!r}, "--single-process", *{args!r}]
runpy.run_path({launch!r}, run_name="__main__")
"""


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-c", SCRIPT.format(launch=str(LAUNCH), args=args)]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(args), capture_output=True, text=True, timeout=600, env=quiet_env(), cwd=REPO)


def _losses(run_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def test_the_single_process_path_imports_without_ray_or_deepspeed():
    """What the launch script's --single-process path imports, in a process where `import ray` and `import deepspeed`
    raise ImportError (the end-to-end run below, under -m slow, trains and exports there)."""
    code = ("import sys; sys.modules['ray'] = None; sys.modules['deepspeed'] = None\n"
            "import workers.trainer.single_process, workers.inputs, workers.driver, workers.lease, workers.preemption\n"
            "import workers.trainer.checkpoint, pipeline.config, pipeline.export, pipeline.metrics\n"
            "from draft_model.registry import build_draft")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=quiet_env(),
                         cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow  # ~30 s: a second end-to-end launch besides the default suite's Ray run (tests/test_faults.py)
def test_trains_and_exports_without_ray_or_deepspeed(tmp_path):
    run_dir = tmp_path / "run"
    res = _run(["--run-dir", str(run_dir), *TINY_MOE, "train.max_steps=20", "train.lr=3e-3",
                "train.head_lr_scale=5"])
    assert res.returncode == 0, res.stderr[-4000:]
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[s] for s in range(1, 5)) / 4, sum(losses[s] for s in range(17, 21)) / 4
    assert last < 0.9 * first, (first, last)
    assert "step 20/20 | loss" in res.stderr
    assert json.loads((run_dir / "export" / "config.json").read_text())["draft"]["vocab_size"] == 49152

    from pipeline.export import load_exported_draft
    from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path

    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    draft = load_exported_draft(run_dir / "export", *embedding_weights(target))
    assert draft.cfg.head == "markov" and draft.head_w2().abs().max() > 0  # the head trained
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    # loss.matmul_dtype=auto: resolved from this CPU, said in the log, saved resolved (a resume keeps it)
    from draft_model.precision import resolve_matmul_dtype

    dtype, why = resolve_matmul_dtype("auto", "cpu")
    assert f"loss matmuls: {dtype} ({why})" in res.stderr
    meta = json.loads((run_dir / "checkpoints" / "step_00000020" / "meta.json").read_text())
    assert meta["config"]["loss"]["matmul_dtype"] == dtype
    lines = (run_dir / "metrics.jsonl").read_text().count("\n")
    # run again on the finished run dir: it resumes at its last step, trains nothing more, exports again
    again = _run(["--run-dir", str(run_dir), *TINY_MOE, "train.max_steps=20", "train.lr=3e-3",
                  "train.head_lr_scale=5"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "at step 20" in again.stderr and (run_dir / "metrics.jsonl").read_text().count("\n") == lines
    assert f"loss matmuls: {dtype} (auto: kept from step_00000020, where the run chose it)" in again.stderr


@pytest.mark.slow
def test_killed_run_resumes_with_the_uninterrupted_losses(tmp_path):
    """SIGKILL after the step-n checkpoint and a logged step past it, start again: steps n+1..2n log the losses of a
    run never stopped (to 1e-6: the same process kind, data, engine state and RNG; only the kill differs), and
    metrics.jsonl holds one row per step (the killed run's rows past n were dropped at the resume)."""
    n = 4
    common = [*TINY_MOE, f"train.max_steps={2 * n}", f"checkpoint.every_steps={n}", "checkpoint.export=false",
              "train.lr=3e-3"]
    straight = tmp_path / "straight"
    res = _run(["--run-dir", str(straight), *common])
    assert res.returncode == 0, res.stderr[-4000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(["--run-dir", str(killed), *common]), cwd=REPO, env=quiet_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == f"step_{n:08d}" and logged_steps(killed) > n:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert latest.read_text().strip() == f"step_{n:08d}"
    assert logged_steps(killed) > n  # rows of steps the resumed run re-trains

    res = _run(["--run-dir", str(killed), *common])
    assert res.returncode == 0, res.stderr[-4000:]
    assert f"resuming from {killed / 'checkpoints' / f'step_{n:08d}'}" in res.stderr
    a, b = _losses(straight), _losses(killed)
    assert sorted(b) == list(range(1, 2 * n + 1))
    rows = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert rows == list(range(1, 2 * n + 1))  # one curve: no step twice
    for step in range(n + 1, 2 * n + 1):
        assert b[step] == pytest.approx(a[step], rel=1e-6, abs=1e-7), (step, a[step], b[step])
    assert latest.read_text().strip() == f"step_{2 * n:08d}"


@pytest.mark.parametrize("args, message", [
    (["train.precision=bf16"], "bf16 (autocast) on a CPU"),
    (["data.max_len=5"], "must exceed draft.block_size"),
    (["--resume"], "has no checkpoint"),
])
def test_bad_input_is_one_clear_error(tmp_path, args, message):
    res = _run(["--run-dir", str(tmp_path / "run"), *TINY_MOE, *args])
    assert res.returncode == 2, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "run" / "export").exists()


@pytest.mark.parametrize("preset, gamma, layers", [("mtp1", 1, 1), ("draft-lm", 3, 2)])
def test_baselines_train_through_the_single_process_trainer(tmp_path, preset, gamma, layers):
    """MTP-1 and the draft LM train 3 steps on the tiny MoE target with finite losses, and their export loads back
    as the same architecture."""
    from pipeline.config import load_config
    from pipeline.export import load_exported_draft
    from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path
    from workers.trainer.single_process import train_single_process

    run_dir = tmp_path / preset
    cfg = load_config(REPO / "launch" / "configs" / "tiny.yaml",
                      [*TINY_MOE, f"draft.preset={preset}", f"draft.block_size={gamma}", f"draft.num_layers={layers}",
                       "train.max_steps=3", "data.num_samples=16", f"checkpoint.run_dir={run_dir}"])
    export = train_single_process(cfg, logging.getLogger("test"), device="cpu")
    rows = read_jsonl_metrics(run_dir / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3] and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows.values())
    for r in rows.values():  # the step's phases, timed inside it (one rank: at most the step's wall time)
        phases = [r["forward_s"], r["backward_s"], r["optimizer_s"]]
        assert all(t > 0 for t in phases) and sum(phases) <= r["step_time_s"], r
    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    draft = load_exported_draft(export, *embedding_weights(target))
    assert (draft.cfg.arch, draft.cfg.block_size, draft.cfg.num_layers) == (cfg.draft.arch, gamma, layers)
