"""Bad input to the launch script: one clear line on stderr, exit status 2 (1 for a failed run), no traceback
soup, and no checkpoint overwritten.

Run: python -m pytest tests/test_launch_errors.py -q
"""

from __future__ import annotations

import json
import shutil

import torch
from launch_helpers import TINY_MOE, run_launch
from safetensors.torch import load_file, save_file


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def _assert_clean_error(res, code: int, *needles: str) -> str:
    assert res.returncode == code, (res.returncode, res.stderr[-3000:])
    line = _last_line(res.stderr)
    assert line.startswith("error: "), res.stderr[-3000:]
    for n in needles:
        assert n in line, line
    return line


def test_unknown_config_key(tmp_path):
    res = run_launch(["--run-dir", str(tmp_path / "r"), "train.learning_rate=1e-3"], timeout=120)
    _assert_clean_error(res, 2, "learning_rate", "valid keys", "'lr'")
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "r").exists()


def test_draft_hidden_or_vocab_not_matching_target(tmp_path):
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, "draft.hidden_size=32"], timeout=300)
    _assert_clean_error(res, 2, "hidden_size=32", "64")
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, "draft.vocab_size=1000"], timeout=300)
    _assert_clean_error(res, 2, "vocab_size=1000", "49152")
    assert "Traceback" not in res.stderr


def test_empty_dataset(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, f"data.source={data}"], timeout=300)
    _assert_clean_error(res, 2, "no samples")
    assert "Traceback" not in res.stderr


def test_sequences_shorter_than_a_block(tmp_path):
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, "data.max_len=5"], timeout=300)
    _assert_clean_error(res, 2, "data.max_len (5) must exceed draft.block_size (5)")
    data = tmp_path / "short.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in ["a", "b", "c"]) + "\n")
    res = run_launch(["--run-dir", str(tmp_path / "r"), *TINY_MOE, f"data.source={data}"], timeout=300)
    line = _assert_clean_error(res, 2)
    assert "shorter than 2 tokens" in line or "no samples" in line, line


def test_nan_features_stop_the_run_without_touching_checkpoints(tmp_path):
    from workers.target.model import resolve_target_path

    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("tiny-qwen3-moe"), target)
    args = ["--run-dir", str(tmp_path / "r"), *TINY_MOE, f"target.path={target}", "checkpoint.every_steps=2",
            "checkpoint.export=false"]
    res = run_launch([*args, "--max-steps", "2"])
    assert res.returncode == 0, res.stderr[-3000:]
    ckpt = tmp_path / "r" / "checkpoints"
    before = {p.relative_to(ckpt): p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.is_file()}

    weights = load_file(str(target / "model.safetensors"))
    norm = next(k for k in weights if k.endswith("norm.weight"))
    weights[norm] = torch.full_like(weights[norm], float("nan"))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})

    res = run_launch([*args, "--max-steps", "4"])
    _assert_clean_error(res, 1, "non-finite target")
    after = {p.relative_to(ckpt): p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.is_file()}
    assert after == before  # nothing written, nothing overwritten
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
