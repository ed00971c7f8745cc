"""launch/calibrate_draft.py and `--prompts FILE` of launch/evaluate_draft.py on a tiny random target and a freshly
built (untrained) export, run as a user runs them: calibration.json is written into the export and every later
load applies it; bad input is one line: a one-line error from evaluation/calibrate.py and evaluation/run.py, which
the CLIs print as `error: ...` with exit status 2.

Run: python -m pytest tests/test_calibrate_cli.py -q     (-m slow adds the calibration run through both CLIs)
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from launch_helpers import run_script

from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from evaluation.calibrate import calibrate
from evaluation.drafters import DecodeContext, load_drafter
from evaluation.rounds import load_round_arrays, load_rounds
from evaluation.run import evaluate_exports
from pipeline.export import export_draft
from serving.calibration import apply_sts, load_calibration, sigmoid
from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path

GAMMA = 3
CHATS = [[{"role": "user", "content": c}] for c in ("Say hi.", "Count to five.", "Name a color.", "What is 2+2?",
                                                     "Write a haiku.", "Spell cat.")]


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return load_target(resolve_target_path("tiny-qwen3-moe"))[0]


@pytest.fixture
def export(tmp_path, target):
    cfg = replace(draft_preset("dspark-markov"), num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, head_rank=8, block_size=GAMMA, target_layers=[1, -1], mask_token_id=3)
    torch.manual_seed(0)
    draft = build_draft(cfg, *embedding_weights(target))
    with torch.no_grad():  # spread the untrained confidence logits, so STS has something to move
        draft.conf_proj.weight.normal_(std=0.5)
    return export_draft(draft.state_dict(), {"draft": draft.cfg.to_dict()}, tmp_path / "run" / "export")


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "held_out.jsonl"
    # a chat, a training-style chat whose assistant reply is dropped, and plain texts
    lines = [{"messages": CHATS[0]}, {"messages": CHATS[1] + [{"role": "assistant", "content": "1 2 3 4 5"}]},
             *({"prompt": c[0]["content"]} for c in CHATS[2:4]), *(c[0]["content"] for c in CHATS[4:])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def cli(script: str, args: list[str]) -> tuple[int, str, str]:
    """Run a CLI -> (exit status, stdout, stderr)."""
    res = run_script(script, args)
    assert res.returncode in (0, 2), res.stderr[-3000:]
    return res.returncode, res.stdout, res.stderr


@pytest.mark.slow  # decodes, fits and evaluates again through both CLIs: about 45 s on 2 cores
def test_calibration_is_written_into_the_export_and_applied_on_load(export, prompt_file, tmp_path, target):
    out = tmp_path / "calib"
    args = ["--draft", str(export), "--target", "tiny-qwen3-moe", "--prompts", str(prompt_file), "--max-new-tokens",
            "8", "--temperature", "1.0", "--out", str(out)]
    code, printed, _ = cli("calibrate_draft.py", args)
    assert code == 0
    assert "held-out" in printed and "ECE before" in printed
    temps, single, meta = load_calibration(export / "calibration.json")
    assert temps.shape == (GAMMA,) and np.all(temps > 0) and meta["decoding_temperature"] == 1.0
    rep = json.loads((out / "calibration_report.json").read_text())
    assert rep["temperatures"] == temps.tolist() and len(rep["ece_before"]) == len(rep["ece_after"]) == GAMMA
    assert (out / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    # the report is on the held-out prompts, disjoint from the ones fitted on, and counts exactly their rounds
    split = rep["prompts"]["held_out"]
    assert set(split["fit"]).isdisjoint(split["held_out"]) and sorted(split["fit"] + split["held_out"]) == list(
        range(len(CHATS)))
    arrays, _ = load_round_arrays(out / "rounds.parquet")
    a = arrays["held_out"]
    assert rep["num_rounds"] == int(np.isin(a["prompt_N"], split["held_out"]).sum())
    assert rep["fit_rounds"] + rep["num_rounds"] == a["num_accepted_N"].size
    # STS on its own fitting data never does worse than T = 1 (1.0 is on the grid)
    assert all(af <= bf + 1e-12 for af, bf in zip(rep["fit_report"]["ece_after"], rep["fit_report"]["ece_before"]))

    # every later load of the export reports calibrated confidences; the raw logits stay available
    drafter = load_drafter(export, target)
    assert drafter.sts_temperatures == temps.tolist()
    feats = torch.randn(5, 2 * target.config.hidden_size)
    prop = drafter.propose(DecodeContext(torch.arange(5), feats), 7, 1.0, torch.Generator().manual_seed(0))
    np.testing.assert_allclose(prop.conf_K.numpy(), apply_sts(prop.conf_logit_K.numpy(), temps), rtol=1e-6)
    raw = load_drafter(export, target, calibrated=False).propose(DecodeContext(torch.arange(5), feats), 7, 1.0,
                                                                torch.Generator().manual_seed(0))
    torch.testing.assert_close(raw.conf_logit_K, prop.conf_logit_K)
    np.testing.assert_allclose(raw.conf_K.numpy(), sigmoid(raw.conf_logit_K.numpy()), rtol=1e-6)

    # evaluate_draft.py --prompts FILE on the calibrated export: the recorded confidences are the calibrated ones
    ev = tmp_path / "eval"
    code, printed, _ = cli("evaluate_draft.py", ["--draft", f"mine={export}", "--target", "tiny-qwen3-moe", "--prompts",
                                                 str(prompt_file), "--num-prompts", "2", "--max-new-tokens", "6",
                                                 "--temperatures", "0.0", "--out", str(ev)])
    assert code == 0
    assert "held_out" in printed
    report = json.loads((ev / "report.json").read_text())
    assert list(report["runs"][0]["datasets"]) == ["held_out"] and report["runs"][0]["sts_temperatures"]
    recorded, _ = load_round_arrays(ev / "mine-T0.0.rounds.parquet")
    calibrated = [r.conf for s in load_rounds(ev / "mine-T0.0.rounds.parquet")["held_out"] for r in s]
    np.testing.assert_allclose(calibrated, apply_sts(recorded["held_out"]["conf_logit_NK"], temps), rtol=1e-6)


def _one_line_error(call, *needles: str) -> None:
    """`call` raises what the CLIs report as one line with exit status 2 (ValueError or FileNotFoundError)."""
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        call()
    err = str(e.value)
    assert "\n" not in err, err
    assert all(n in err for n in needles), err


def test_bad_input_is_one_line_and_exit_2(export, prompt_file, tmp_path):
    out = tmp_path / "o"

    def run(draft, prompts, temperature=1.0):  # launch/calibrate_draft.py's call, with its defaults
        return lambda: calibrate(Path(draft), "tiny-qwen3-moe", [str(p) for p in prompts], 40, 64, temperature, out)

    def evaluate(draft, prompts=(), temperatures=(1.0, 0.0)):  # launch/evaluate_draft.py's call, with its defaults
        datasets = [str(p) for p in prompts] or ["humaneval", "gsm8k", "mtbench"]
        return lambda: evaluate_exports({Path(draft).parent.name: Path(draft)}, "tiny-qwen3-moe", datasets, 10, 64,
                                        list(temperatures), out)

    _one_line_error(run(tmp_path / "nope", [prompt_file]), "not an exported draft")
    garbage = tmp_path / "p.parquet"
    garbage.write_bytes(b"\x00\x01 not parquet")
    _one_line_error(run(export, [garbage]), "cannot read")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _one_line_error(run(export, [empty]), "no prompts")
    for t in (-1.0, float("nan")):
        _one_line_error(run(export, [prompt_file], temperature=t), "decoding temperature must be a finite number")
    _one_line_error(run(export, [tmp_path / "missing.jsonl"]), "does not exist")
    _one_line_error(evaluate(export, [empty]), "no prompts")
    _one_line_error(evaluate(tmp_path / "nope"), "not an exported")
    _one_line_error(evaluate(export, temperatures=[-0.5]), "temperatures")
    # each CLI prints such an error as one line and exits with status 2
    base = ["--target", "tiny-qwen3-moe", "--out", str(out)]
    for script, args, needle in (("calibrate_draft.py", ["--draft", str(tmp_path / "nope"), "--prompts",
                                                         str(prompt_file)], "not an exported draft"),
                                 ("evaluate_draft.py", ["--draft", str(export), "--temperatures", "-0.5"],
                                  "temperatures")):
        code, _, err = cli(script, [*args, *base])
        assert code == 2
        err = err.strip()
        assert err.startswith("error: ") and "\n" not in err and needle in err, err
    assert not (export / "calibration.json").exists()  # nothing was written by the failed runs
