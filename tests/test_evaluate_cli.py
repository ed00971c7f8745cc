"""launch/evaluate_draft.py on an exported (untrained) draft over the real evaluation prompt sets, run as a user runs
it; its speed-up table (evaluation/report.py) on hand-made results.

Run: python -m pytest tests/test_evaluate_cli.py -q
"""

import json
from dataclasses import replace

import pytest
import torch
from launch_helpers import run_script

from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from evaluation.rounds import load_rounds
from pipeline.export import export_draft
from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path


def export_untrained_draft(out) -> None:
    """A seeded, untrained 1-layer DSpark (γ = 3) on the tiny Qwen3-MoE target, exported to `out`."""
    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    cfg = replace(draft_preset("dspark-markov"), num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, head_rank=8, block_size=3, target_layers=[1, -1], mask_token_id=3)
    torch.manual_seed(0)
    draft = build_draft(cfg, *embedding_weights(target))
    export_draft(draft.state_dict(), {"draft": draft.cfg.to_dict()}, out)


def cli(args: list[str]) -> tuple[int, str]:
    """Run the CLI -> (exit status, stdout)."""
    res = run_script("evaluate_draft.py", args)
    assert res.returncode in (0, 2), res.stderr[-3000:]
    return res.returncode, res.stdout


def test_cli_writes_report_plot_and_recorded_rounds(tmp_path):
    """Without --out (as the README's first evaluation command runs it), the report goes to eval/ beside the draft."""
    export_untrained_draft(tmp_path / "export")
    args = ["--draft", f"mine={tmp_path / 'export'}", "--target", "tiny-qwen3-moe", "--num-prompts", "1",
            "--max-new-tokens", "6", "--temperatures", "0.0"]
    code, table = cli(args)
    assert code == 0
    assert "mine" in table and "humaneval" in table and "mtbench" in table
    assert f"report: {tmp_path / 'eval' / 'report.md'}" in table
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert (tmp_path / "eval" / "acceptance.png").stat().st_size > 0
    assert report and (tmp_path / "eval" / "mine-T0.0.json").is_file()
    streams = load_rounds(tmp_path / "eval" / "mine-T0.0.rounds.parquet")  # recorded rounds, one stream per prompt
    assert set(streams) == {"humaneval", "gsm8k", "mtbench"} and all(len(s) == 1 for s in streams.values())


@pytest.mark.slow  # two more CLI runs (about 15 s on 2 cores)
def test_cli_reuses_a_cached_result_and_refuses_an_unknown_dataset(tmp_path):
    export_untrained_draft(tmp_path / "export")
    args = ["--draft", f"mine={tmp_path / 'export'}", "--target", "tiny-qwen3-moe", "--num-prompts", "1",
            "--max-new-tokens", "6", "--temperatures", "0.0", "--datasets", "gsm8k", "--out", str(tmp_path / "eval")]
    assert cli(args)[0] == 0
    cached = (tmp_path / "eval" / "mine-T0.0.json").stat().st_mtime_ns
    assert cli(args)[0] == 0  # a second run reuses the cached result
    assert (tmp_path / "eval" / "mine-T0.0.json").stat().st_mtime_ns == cached
    assert cli([*args[:-4], "--datasets", "nope", "--out", str(tmp_path / "e2")])[0] == 2


@pytest.mark.slow  # a second CLI run (about 45 s on 2 cores); the first one above stays in the default suite
def test_cli_autoregressive_baseline_gives_speedups(tmp_path):
    from evaluation.report import speedup_table

    export_untrained_draft(tmp_path / "export")
    args = ["--draft", f"mine={tmp_path / 'export'}", "--target", "tiny-qwen3-moe", "--num-prompts", "1",
            "--max-new-tokens", "6", "--temperatures", "1.0", "--autoregressive", "--out", str(tmp_path / "eval")]
    code, out = cli(args)
    assert code == 0
    assert "end-to-end speed-up" in out and "autoregressive" in out
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "eval").glob("*-T1.0.json"))]
    base = next(r for r in results if r["drafter"] == "autoregressive")
    assert all(m["tau"] == 1.0 for m in base["datasets"].values())
    mine = next(r for r in results if r["drafter"] == "mine")
    _, macro = speedup_table(results)
    want = sum(mine["datasets"][ds]["tokens_per_s"] / base["datasets"][ds]["tokens_per_s"]
               for ds in base["datasets"]) / 3
    assert abs(macro[("mine", 1.0)] - want) < 1e-12 and mine["datasets"]["gsm8k"]["draft_s_median"] > 0
    assert cli(["--draft", f"autoregressive={tmp_path / 'export'}", *args[2:]])[0] == 2  # the baseline's name


def test_speedup_table_pairs_only_drafts_decoded_in_turn_with_the_baseline():
    from evaluation.report import speedup_table

    def res(name, tok_s, batch, prompts=2):
        return {"drafter": name, "temperature": 1.0, "decode_batch": batch,
                "datasets": {"a": {"tokens_per_s": tok_s, "num_prompts": prompts, "draft_s_median": 0.01}}}

    text, macro = speedup_table([res("autoregressive", 10.0, "x"), res("new", 15.0, "x"), res("old", 30.0, "y"),
                                 res("cut", 20.0, "x", prompts=1)])
    assert macro == {("new", 1.0): 1.5}
    assert "old" in text and "cached from another run" in text and "other prompts" in text
