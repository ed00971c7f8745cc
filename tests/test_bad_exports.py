"""The evaluator and the exporter on damaged inputs: an exported draft whose config.json or weights are damaged or
do not fit each other, and a damaged target directory, each one line naming the file and exit status 2, no
traceback (issue #47, item 3). Both CLIs run in this process (launch/evaluate_draft.py, launch/export_draft.py).

Run: python -m pytest tests/test_bad_exports.py -q
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_model import build_draft
from draft_model.presets import draft_preset
from pipeline.export import export_draft
from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path

REPO = Path(__file__).resolve().parents[1]


def _cli(script: str):
    spec = importlib.util.spec_from_file_location(f"_bad_{script}", REPO / "launch" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """An untrained servable draft on the tiny Qwen3-MoE target (target named in its config.json)."""
    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    cfg = replace(draft_preset("dspark-markov"), num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, head_rank=8, block_size=3, target_layers=[0, 1], mask_token_id=3)
    torch.manual_seed(0)
    draft = build_draft(cfg, *embedding_weights(target))
    out = tmp_path_factory.mktemp("export") / "export"
    export_draft(draft.state_dict(), {"draft": draft.cfg.to_dict(), "target": "tiny-qwen3-moe"}, out)
    return out


def _one_error_line(capsys, code: int) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in re.split(r"[\r\n]", err) if ln.startswith("error: ")]  # besides log lines and bars
    assert code == 2 and len(lines) == 1, (code, err[-2000:])
    assert "Traceback" not in out + err
    return lines[0]


def _damaged_copy(export: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / "export"
    shutil.copytree(export, d)
    path = d / DAMAGES[name][0]
    DAMAGES[name][1](path)
    return d


def _edit_draft(path: Path) -> None:
    meta = json.loads(path.read_text())
    meta["draft"]["intermediate_size"] = 96
    path.write_text(json.dumps(meta))


DAMAGES = {  # name: (the file damaged, how, the file the line names, what it says after that file's path)
    "config.json cut short": ("config.json", lambda p: p.write_bytes(p.read_bytes()[:30]), "config.json",
                              " is not valid JSON ("),
    "config.json a list": ("config.json", lambda p: p.write_text("[]"), "config.json", " has no 'draft' section"),
    "weights cut short": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-10]), "model.safetensors",
                          " is not a readable safetensors file (SafetensorError: Error while deserializing header: "
                          "incomplete metadata, file not fully covered)"),
    "weights of another width than config.json": (
        "config.json", _edit_draft, "model.safetensors",
        ": backbone.layers.0.ffn.down_proj.weight is [64, 64], but its config.json makes it [64, 96]"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_export_is_one_line_in_the_evaluator_and_the_exporter(export, tmp_path, capsys, name):
    d = _damaged_copy(export, tmp_path, name)
    _, _, file, needle = DAMAGES[name]
    evaluated = _one_error_line(capsys, _cli("evaluate_draft")(
        ["--draft", str(d), "--target", "tiny-qwen3-moe", "--datasets", "gsm8k", "--num-prompts", "1",
         "--out", str(tmp_path / "eval")]))
    exported = _one_error_line(capsys, _cli("export_draft")([str(d), "--format", "deepspec", "--out",
                                                             str(tmp_path / "deepspec")]))
    for line in (evaluated, exported):
        assert f"{d / file}{needle}" in line, line


def test_a_damaged_target_is_one_line_in_the_evaluator_and_the_exporter(export, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(resolve_target_path("tiny-qwen3-moe"), target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    want = f"error: target {weights} is not a readable safetensors file (SafetensorError: "
    evaluated = _one_error_line(capsys, _cli("evaluate_draft")(
        ["--draft", str(export), "--target", str(target), "--datasets", "gsm8k", "--num-prompts", "1",
         "--out", str(tmp_path / "eval")]))
    exported = _one_error_line(capsys, _cli("export_draft")(
        [str(export), "--format", "deepspec", "--target", str(target), "--out", str(tmp_path / "deepspec")]))
    assert evaluated.startswith(want) and exported.startswith(want), (evaluated, exported)
