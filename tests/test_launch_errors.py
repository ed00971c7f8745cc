"""Bad input to a run: one clear line, exit status 2 (1 for a failed run), no traceback soup, and no checkpoint
overwritten.

The messages come from the config (pipeline/config.py, ConfigError) and the driver's input resolution
(workers/inputs.py, InputError), which both trainers run before any worker starts; they are checked here
in-process, in seconds. What the launch script adds (`error: ` + that line on stderr, exit status 2 for both
kinds, 1 for any other failure with its root cause) is checked once through the real script; the Ray pipeline's
"NaN features fail the run and touch no checkpoint" runs end to end under the `slow` marker.

Run: python -m pytest tests/test_launch_errors.py -q     (about 40 s on 2 cores; -m slow adds the Ray run, 2 min)
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from launch_helpers import REPO, TINY_MOE, run_launch
from safetensors.torch import load_file, save_file

from pipeline.config import ConfigError, RunConfig, load_config
from pipeline.errors import InputError
from workers.inputs import resolve_inputs

TINY = REPO / "launch" / "configs" / "tiny.yaml"  # the launch script's default config
LOG = logging.getLogger("test_launch_errors")


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def _assert_clean_error(res, code: int, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    line = _last_line(res.stderr)
    assert line.startswith("error: "), res.stderr[-3000:]
    for n in needles:
        assert n in line, line
    return line


def _config(run_dir: Path, *overrides: str) -> RunConfig:
    """What `launch/train_v4_draft.py --run-dir RUN_DIR OVERRIDES` builds."""
    return load_config(TINY, [*overrides, f"checkpoint.run_dir={run_dir}"])


def _input_error(cfg: RunConfig, *needles: str) -> str:
    """The one line the launch script prints after `error: ` (exit status 2: an InputError) for this config."""
    with pytest.raises(InputError) as info:
        resolve_inputs(cfg, LOG)
    line = str(info.value)
    assert "\n" not in line, line
    for n in needles:
        assert n in line, line
    return line


def test_the_script_prints_one_line_and_exits_2_for_a_bad_config_or_input(tmp_path):
    """The launch script's half of the contract, once each for a config error and an input error."""
    res = run_launch(["--run-dir", str(tmp_path / "r"), "train.learning_rate=1e-3"], timeout=120)
    _assert_clean_error(res, 2, "learning_rate", "valid keys", "'lr'")
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()

    data = tmp_path / "empty.jsonl"
    data.write_text("")
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, f"data.source={data}"], timeout=300)
    _assert_clean_error(res, 2, "no samples")
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()  # refused before the run dir is made


def test_unknown_config_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path / "r", "train.learning_rate=1e-3")
    line = str(info.value)
    assert "\n" not in line and "learning_rate" in line and "valid keys" in line and "'lr'" in line, line
    assert not (tmp_path / "r").exists()


def test_draft_hidden_or_vocab_not_matching_target(tmp_path):
    _input_error(_config(tmp_path / "r", *TINY_MOE, "draft.hidden_size=32"), "hidden_size=32", "64")
    _input_error(_config(tmp_path / "r", *TINY_MOE, "draft.vocab_size=1000"), "vocab_size=1000", "49152")


def test_empty_dataset(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    _input_error(_config(tmp_path / "r", *TINY_MOE, f"data.source={data}"), "no samples")


def test_sequences_shorter_than_a_block(tmp_path):
    with pytest.raises(ValueError, match=r"^data.max_len \(5\) must exceed draft.block_size \(5\)"):
        _config(tmp_path / "r", *TINY_MOE, "data.max_len=5")  # a config error now: both values are the config's
    data = tmp_path / "short.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["a", "b", "c"]) + "\n")
    line = _input_error(_config(tmp_path / "r", *TINY_MOE, f"data.source={data}"))
    assert "shorter than 2 tokens" in line or "no samples" in line, line


def _nan_target(tmp_path: Path) -> tuple[Path, Callable[[], None]]:
    """A private copy of the tiny MoE target, and a function that sets one of its norms to NaN."""
    from workers.frozen_target.model import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("tiny-qwen3-moe"), target)

    def poison() -> None:
        weights = load_file(str(target / "model.safetensors"))
        norm = next(k for k in weights if k.endswith("norm.weight"))
        weights[norm] = torch.full_like(weights[norm], float("nan"))
        save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})

    return target, poison


def _files(ckpt: Path) -> dict:
    return {p.relative_to(ckpt): p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.is_file()}


def test_nan_features_stop_the_run_without_touching_checkpoints(tmp_path):
    """In one process (the single-process trainer runs the same decode, loop and checkpointer as the Ray
    trainers): a failed run, exit status 1 with the root cause as its line, and nothing written."""
    from workers.driver import root_cause
    from workers.trainer.checkpoint import CheckpointManager
    from workers.trainer.single_process import train_single_process

    target, poison = _nan_target(tmp_path)
    run_dir = tmp_path / "r"
    args = [*TINY_MOE, f"target.path={target}", "checkpoint.every_steps=2", "checkpoint.export=false"]
    train_single_process(_config(run_dir, *args, "train.max_steps=2"), LOG, device="cpu")
    ckpt = run_dir / "checkpoints"
    before = _files(ckpt)

    poison()
    latest = CheckpointManager(run_dir).latest()
    with pytest.raises(Exception) as info:
        train_single_process(_config(run_dir, *args, "train.max_steps=4"), LOG, device="cpu", resume_from=latest)
    assert not isinstance(info.value, InputError)  # exit status 1 (a failed run), not 2
    assert root_cause(info.value).startswith("ValueError: non-finite target"), root_cause(info.value)
    assert _files(ckpt) == before  # nothing written, nothing overwritten
    assert (ckpt / "latest").read_text().strip() == "step_00000002"


@pytest.mark.slow
def test_nan_features_stop_the_ray_run_without_touching_checkpoints(tmp_path):
    """The same through the launch script, the Ray trainers and the feature service (about 2 min)."""
    target, poison = _nan_target(tmp_path)
    args = ["--run-dir", str(tmp_path / "r"), *TINY_MOE, f"target.path={target}", "checkpoint.every_steps=2",
            "checkpoint.export=false"]
    res = run_launch([*args, "--max-steps", "2"])
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = tmp_path / "r" / "checkpoints"
    before = _files(ckpt)

    poison()
    res = run_launch([*args, "--max-steps", "4"])
    _assert_clean_error(res, 1, "non-finite target")
    assert _files(ckpt) == before  # nothing written, nothing overwritten
    assert (ckpt / "latest").read_text().strip() == "step_00000002"


def test_a_stale_current_cluster_file_is_pointed_at_this_run_and_a_live_one_is_kept(tmp_path):
    """Ray Train's placement-group cleaner finds the cluster through Ray's current-cluster file: one left by a dead
    `ray start` head made it time out with a traceback on a healthy local run (workers/driver.py)."""
    import socket

    from workers.driver import replace_stale_cluster_file

    path = tmp_path / "ray_current_cluster"
    assert not replace_stale_cluster_file("127.0.0.1:1111", path)  # no file: nothing written
    assert not path.exists()
    with socket.socket() as dead:  # a port nobody listens on once closed
        dead.bind(("127.0.0.1", 0))
        stale = f"127.0.0.1:{dead.getsockname()[1]}"
    path.write_text(stale + "\n")
    assert replace_stale_cluster_file("127.0.0.1:2222", path) and path.read_text() == "127.0.0.1:2222"
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        path.write_text(f"127.0.0.1:{live.getsockname()[1]}")
        assert not replace_stale_cluster_file("127.0.0.1:3333", path)
        assert path.read_text() == f"127.0.0.1:{live.getsockname()[1]}"
