"""Every benchmark in bench/ still runs: each script with its smallest arguments, as a subprocess, as a user runs it,
and its figure line (the last line it prints) has the shape that bench promises. The numbers themselves are not
checked (a smoke run is too small to mean anything), except where the shape is a correctness claim: the fault bench
must report no duplicate and no lost sample, the abuse bench's --quick cases must all be clean.

Every run takes from half a minute (packing, loss memory) to several minutes (faults, drafters) on 2 cores, so
they are all `slow`; the default suite only checks that no bench script lacks a case here.

Run: python -m pytest tests/test_bench_smoke.py -q -m slow     (about 30 minutes on 2 cores)
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import REPO, TINY_MOE, quiet_env

BENCH = REPO / "bench"
# modules the scripts share, not measurements: they have no figure line
HELPERS = {"flops", "launch_helpers", "llamacpp", "peak_rss", "prompt_sets", "sim_cluster", "sweep_summary",
           "vllm_side_dflash", "vllm_side_dspark",  # the vLLM environment's halves of serve_vllm
           "vllm_side_scheduler"}  # and of scheduler_vllm
# benches this suite does not run, with the reason (the others run on the CPU with what CI installs, the SmolLM2
# wheel and the evaluation prompt sets of the README's install line included)
EXCLUDED: dict[str, str] = {
    # its --cpu mode runs in the default suite, with every check's verdict asserted, not only the figure line
    "gpu_smoke": "tests/test_gpu_smoke.py",
    "serve_vllm": "needs the vLLM environment, which CI does not install: tests/test_serve_vllm.py runs its --quick "
                  "case (-m vllm)",
    "scheduler_vllm": "needs the vLLM environment, which CI does not install: tests/test_scheduler_vllm.py runs it on "
                      "synthetic rounds (-m vllm)",
    "node_loss": "a multi-node rehearsal of several minutes (five raylets, two killed): tests/test_node_loss.py "
                 "runs its cases, the target-node loss in the default suite and the trainer-node loss as slow",
    "target_backends": "needs the vLLM environment, which CI does not install; its equality with transformers is "
                       "tests/test_vllm_target.py's (-m vllm)",
}

NUM = r"\d+(?:\.\d+)?"
SCI = r"\d\.\d{2}e[-+]\d+"
# name -> (arguments, the regex its figure line must match in full, timeout in seconds). {tmp} is a fresh directory.
# A name is the script's, or script:variant for a second case of one script.
CASES: dict[str, tuple[list[str], str, int]] = {
    # the v4-flash estimate under fake tensors (a minute or two): the trainer's and the target rank's memory
    "memory": (["--preset", "v4-flash"],
               rf"memory preset=v4-flash trainer_peak_gib={NUM} target_weights_gib={NUM} target_capture_gib={NUM} "
               rf"gpu_gib=80 fits=(?:yes|no)", 900),
    "packing": (["--anchors", "8", "--seq-per-batch", "4", "--batches-per-pack", "1"],
                rf"packing_density={NUM} padded={NUM} ratio={NUM}", 300),
    "loss_memory": (["--anchors", "8", "--vocab", "512", "--hidden", "64", "--rank", "8", "--probe-anchors", "4"],
                    rf"peak_memory chunked/naive={NUM} time chunked/naive={NUM} values_max_rel_diff={SCI}", 300),
    "step": (["--seqs", "1", "--seq-len", "256", "--anchors", "4", "--vocab", "512", "--hidden", "64", "--steps", "1",
              "--repeats", "1"],
             rf"step full_ctx time old/new={NUM} peak_mem old/new={NUM} swa time old/new={NUM} util={NUM}", 600),
    "target_parallel": (["--batches", "1", "--samples", "2", "--seq-len", "32"],
                        rf"target_parallel tp=2 max_abs_diff={SCI} per_rank_param_bytes tp2/tp1={NUM} "
                        rf"feature_tok_s tp2/tp1={NUM}", 600),
    "transport": (["--steps", "1", *TINY_MOE],
                  rf"bytes_per_trained_token hidden={NUM} logits=\d+ ratio logits/hidden={NUM}x", 600),
    "pipeline_overlap": (["--steps", "1", "--warmup", "1", *TINY_MOE],
                         rf"pipeline_tok_s={NUM} target_only={NUM} trainer_only={NUM} "
                         rf"ratio pipeline/min\(parts\)={NUM}", 900),
    # two launches (fresh, then resumed) on a synthetic data stage of 2000 samples up to 8k tokens
    "data_scale": (["--samples", "2000", "--steps", "2", "--work-dir", "{tmp}/work"],
                   rf"data_scale samples=2000 first_step_s={NUM} driver_peak_rss_gb={NUM} service_peak_rss_gb={NUM} "
                   rf"resume_s={NUM}", 900),
    "regenerate_throughput": (["--max-new-tokens", "4", "--batch-sizes", "4"],
                              rf"batch 4: +{NUM} s \| \d+ new tokens \| +{NUM} tok/s \| \d+/\d+ finished", 600),
    "heldout_acceptance": (["a={tmp}/a", "b={tmp}/b", "--target", "tiny-qwen3-moe", "--prompts", "1", "--max-new", "4",
                            "--anchors", "4", "--cache", "{tmp}/replies.pt"],
                           rf"a - b: expected tau [-+]{NUM} \+- {NUM} \(standard error over \d+ sequences\)", 600),
    # every --quick case ends before Ray starts with exit 2 and one line: all of them must be clean
    "abuse": (["--quick", "--work-dir", "{tmp}/work"],
              r"abuse cases=(\d+) clean=\1 exit2=\1 tracebacks=0 retried=0 orphan_commits=0", 1500),
    "faults": (["--quick", "--out", "{tmp}/faults"],
               rf"faults samples_trained=\d+ duplicates=0 lost=0 max_loss_diff={SCI} slowdown={NUM}", 1200),
    "scheduling": (["--quick", "--work-dir", "{tmp}/work"],
                   rf"scheduling alg1/best_static@knee={NUM} async/best_static@knee={NUM} worst_over_sweep={NUM} "
                   rf"per_user dspark/mtp1@matched_throughput={NUM}", 3600),
    # the data stage of bench/scheduling.py --quick (QUICK_TRAIN): fewer prompts or shorter replies leave no reply
    # that finishes within its budget, and the data stage drops unfinished ones
    "drafters": (["--scale", "cpu", "--work-dir", "{tmp}/work", "--drafters", "dspark", "dflash", "eagle3",
                  "--steps", "2", "--temperatures", "1.0", "--trainer", "single",
                  "--scale-set", "train_prompts=16", "regen_max_new=32", "regen_batch=8", "regen_ray=false",
                  "eval_prompts=1", "eval_max_new=8", "anchors_per_seq=8", "trainers=1"],
                 rf"tau_ratio dspark/dflash={NUM} dspark/eagle3={NUM}", 1800),
    # an untrained 2-stage v4-deepseek on the tiny MoE target (_prepare), window 16 on 64-token texts
    "dsv4_window": (["--export", "{tmp}/export", "--target", "tiny-qwen3-moe", "--seqs", "2", "--len", "64"],
                    rf"dsv4_window export=\S+ blocks=\d+ tau_reference={NUM} tau_llamacpp={NUM} greedy_differs={NUM}",
                    600),
    # llama.cpp b11434 is built first (bench/llamacpp.py, cached under ~/.cache/dspark: tens of minutes once)
    "serve_llamacpp": (["--quick", "--steps", "2", "--run-dir", "{tmp}/run"],
                       rf"serve engine=llama\.cpp tau_engine_T0={NUM} tau_ours_T0={NUM} agreement_T0={NUM} "
                       rf"rounds_equal_T0={NUM} controls_caught=\d controls=3 tau_engine_T1={NUM} tau_ours_T1={NUM} "
                       rf"agreement_T1={NUM} speedup_T0={NUM} speedup_T1={NUM}", 3600),
    # DeepSeek-V4's drafter block on the tiny MoE target: our GGUF, the DeepSeek checkpoint through llama.cpp's
    # converter, round by round against our evaluator
    "serve_llamacpp:v4-deepseek": (["--preset", "v4-deepseek", "--target", "tiny-qwen3-moe", "--quick", "--steps",
                                    "2", "--run-dir", "{tmp}/run"],
                                   rf"serve engine=llama\.cpp preset=v4-deepseek target=tiny-qwen3-moe "
                                   rf"tau_engine_T0={NUM} tau_ours_T0={NUM} agreement_T0={NUM} rounds_equal_T0={NUM} "
                                   rf"fp4_tau_T0={NUM}", 1800),
    # the draft-quality curve: a 16-prompt data stage, two marks 36 CPU-s apart (a 2-step first segment, then at
    # least one resumed one), served by llama.cpp with a reduced draft vocabulary (bench's default, padded: the
    # stage's replies use fewer distinct tokens) at the fastest of two block lengths x two confidence thresholds
    "learning_curve": (["--data-prompts", "16", "--regen-max-new", "32", "--hours", "0.01", "0.02", "--first-steps",
                        "2", "--per-set", "1", "--max-new-tokens", "8", "--p-min", "0", "0.5", "--gammas", "2", "5",
                        "--work-dir", "{tmp}/work"],
                       rf"learning_curve cpu_h={NUM} trained_tokens=\d+ tau_T0_ours={NUM} tau_T0_engine={NUM} "
                       rf"speedup_T0_engine={NUM} tau_T1_ours={NUM}", 1800),
    # one arm of a comparison at equal CPU-hours: real text (32 rows of the embedded corpus), our evaluator only
    "learning_curve:real": (["--data", "default", "--real-samples", "32", "--ours-only", "--hours", "0.005",
                             "--first-steps", "2", "--per-set", "1", "--max-new-tokens", "8",
                             "--work-dir", "{tmp}/work"],
                            rf"learning_curve cpu_h={NUM} trained_tokens=\d+ tau_T0_ours={NUM} tau_T0_engine=nan "
                            rf"speedup_T0_engine=nan tau_T1_ours={NUM}", 1200),
    # two arms at equal CPU-hours on real text (32 rows of the embedded corpus), the second with another lr
    "curve_arms": (["--hours", "0.005", "--per-set", "1", "--max-new-tokens", "8", "--first-steps", "2",
                    "--work-dir", "{tmp}/work", "--arm", "a", "default", "data.num_samples=32",
                    "--arm", "b", "default", "data.num_samples=32", "train.lr=3e-3"],
                   rf"curve_arms cpu_h={NUM} best_T0=[ab] tau_T0={NUM} gain_vs_first_T0=(?:-?{NUM}|nan) best_T1=[ab] "
                   rf"tau_T1={NUM} gain_vs_first_T1=(?:-?{NUM}|nan)", 1800),
    # where a CPU-hour goes: the default run single-process, then on Ray with 1 and 2 trainers (tiny MoE target)
    "train_cost": (["--steps", "2", "--work-dir", "{tmp}/work", *TINY_MOE],
                   rf"train_cost cpu_ms_per_token single={NUM} ray1={NUM} ray2={NUM} ratio ray2/single={NUM} "
                   rf"ray1/single={NUM}", 1200),
    # speculators lives in its own venv (SPEC_VENV, made once here: its transformers pin conflicts with ours)
    "speculators_roundtrip": (["--venv", "{venv}"],
                              rf"speculators_roundtrip variants=4 max_abs_dlogit={SCI} max_abs_dconf={SCI} pass=4/4 "
                              rf"control_caught=6/6", 1800),
}
SPEC_VENV = Path.home() / ".cache" / "dspark" / "specvenv"


def _scripts() -> set[str]:
    return {p.stem for p in BENCH.glob("*.py")} - HELPERS


def _script(name: str) -> str:
    return name.split(":")[0]


def test_every_bench_script_has_a_smoke_case():
    cased = {_script(n) for n in CASES}
    assert _scripts() == cased | set(EXCLUDED), "add the new bench to CASES (or EXCLUDED, with the reason)"
    assert not cased & set(EXCLUDED)


@pytest.mark.parametrize("args, message", [
    (["--p-min", "1.5"], "--p-min takes confidences in [0, 1]"),
    (["--gammas", "0", "5"], "--gammas takes block lengths of at least 1"),
    (["--draft-vocab", "-1"], "--draft-vocab must be 0"),
    (["--data", "default"], "with --data default pass --draft-vocab 0"),
])
def test_learning_curve_refuses_bad_serving_settings_before_anything_runs(args, message, tmp_path):
    from learning_curve import main

    with pytest.raises(SystemExit) as e:
        main([*args, "--work-dir", str(tmp_path / "w")])
    assert str(e.value).startswith("error: ") and message in str(e.value), e.value
    assert not (tmp_path / "w").exists()


def test_learning_curve_extrapolates_a_nearly_flat_curve_in_log_space():
    """Where τ barely rises between marks, the CPU-hours to break-even are astronomically many: printed as a power
    of ten (exp() of the fit overflowed a float and killed the bench after every mark had been evaluated)."""
    from learning_curve import extrapolate

    mark = dict(tau_T0_engine_pooled=1.04, speedup_T0_engine=0.6, speedup_T0_engine_full=0.52, tau_T0_ours=1.05)
    flat = [dict(mark, cpu_h=0.01, tau_T0_engine=1.04), dict(mark, cpu_h=0.02, tau_T0_engine=1.0400001)]
    line = extrapolate(flat)
    assert "break-even tau 2.00" in line, line
    assert re.search(r"reached at about 10\^\d{6,}\.\d CPU-h", line), line
    rising = [dict(mark, cpu_h=0.01, tau_T0_engine=1.04), dict(mark, cpu_h=0.02, tau_T0_engine=1.1)]
    # tau - 1 = a ln h + b through both marks; break-even 2.0 at ln h = (1 - b) / a
    a = (0.1 - 0.04) / math.log(2)
    b = 0.04 - a * math.log(0.01)
    assert f"10^{(1 - b) / a / math.log(10):.1f} CPU-h" in extrapolate(rising)


def test_learning_curve_extrapolates_the_tuned_speed_up_to_one():
    """The second line fits the speed-up the bench reports (γ and p-min tuned per mark) against ln CPU-h and says
    where it reaches 1.0, in CPU-hours; a falling speed-up has no such point, and a speed-up past 1 says so."""
    from learning_curve import extrapolate

    mark = dict(tau_T0_engine_pooled=1.3, speedup_T0_engine_full=0.65, tau_T0_ours=1.3, tau_T0_engine=1.3)
    rising = [dict(mark, cpu_h=0.5, speedup_T0_engine=0.88),
              dict(mark, cpu_h=1.0, speedup_T0_engine=0.9, tau_T0_engine=1.29)]  # τ falls, the speed-up rises
    tau_line, speed_line = extrapolate(rising).split("\n")
    assert tau_line.startswith("extrapolation: tau_T0_engine - 1 =") and "no rising trend" in tau_line
    a = 0.02 / math.log(2)  # speed-up = a ln h + 0.9 through both marks: 1.0 at ln h = 0.1 / a
    assert speed_line.startswith(f"extrapolation: speedup_T0_engine = {a:.4f} ln(cpu_h) + 0.9000 over 2 marks")
    assert speed_line.endswith(f"1.0 reached at about 10^{0.1 / a / math.log(10):.1f} CPU-h "
                               f"({math.exp(0.1 / a):.3g} CPU-h) if the trend held"), speed_line
    falling = [dict(mark, cpu_h=0.5, speedup_T0_engine=0.9), dict(mark, cpu_h=1.0, speedup_T0_engine=0.88)]
    assert extrapolate(falling).endswith("1.0 no rising trend to extrapolate")
    past = [dict(mark, cpu_h=0.5, speedup_T0_engine=0.95), dict(mark, cpu_h=1.0, speedup_T0_engine=1.02)]
    assert extrapolate(past).endswith("1.0 already past it")


def _export_untrained_dsv4(out: Path) -> None:
    from dataclasses import replace

    import torch

    from draft_model import build_draft, draft_preset
    from draft_model.config import DSV4Config
    from pipeline.export import export_draft
    from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path

    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    cfg = draft_preset("v4-deepseek", 3)
    cfg = replace(cfg, num_layers=2, num_heads=4, head_dim=16, sliding_window=16, head_rank=8, mask_token_id=3,
                  moe=replace(cfg.moe, num_experts=4, expert_intermediate_size=32),
                  dsv4=DSV4Config(q_lora_rank=16, rope_head_dim=8, o_groups=2, o_lora_rank=16))
    torch.manual_seed(0)
    draft = build_draft(cfg, *embedding_weights(target))
    export_draft(draft.state_dict(), {"draft": draft.cfg.to_dict()}, out)


def _prepare(name: str, tmp: Path) -> None:
    if name == "heldout_acceptance":  # it compares exported drafts: two untrained ones on the tiny MoE target
        from test_evaluate_cli import export_untrained_draft

        for d in ("a", "b"):
            export_untrained_draft(tmp / d)
    if name == "dsv4_window":
        _export_untrained_dsv4(tmp / "export")
    if _script(name) == "serve_llamacpp" or name == "learning_curve":  # learning_curve:real does not serve
        import llamacpp

        llamacpp.build()
    if name == "speculators_roundtrip" and not (SPEC_VENV / "bin" / "python").is_file():
        pip = str(SPEC_VENV / "bin" / "pip")
        subprocess.run([sys.executable, "-m", "venv", str(SPEC_VENV)], check=True)
        subprocess.run([pip, "install", "speculators==0.9.0", "torch==2.13.0"], check=True)
        subprocess.run([pip, "uninstall", "-y", "torchvision", "torchaudio"], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_prints_its_figure_line(name, tmp_path):
    args, pattern, timeout = CASES[name]
    _prepare(name, tmp_path)
    cmd = [sys.executable, str(BENCH / f"{_script(name)}.py"), *(a.format(tmp=tmp_path, venv=SPEC_VENV) for a in args)]
    res = subprocess.run(cmd, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    lines = res.stdout.strip().splitlines()
    assert lines, res.stderr[-3000:]
    assert re.fullmatch(pattern, lines[-1].strip()), (lines[-1], pattern)


# A parent that does not wait for its child (SIGCHLD ignored: the kernel reaps the child and drops its CPU
# time), as Ray's raylet treats its workers; the child burns CPU meanwhile.
UNWAITED = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
burn = "import time\\nend = time.process_time() + 0.8\\nwhile time.process_time() < end: pass"
pid = subprocess.Popen([sys.executable, "-c", burn]).pid
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        break
    time.sleep(0.05)
"""


def test_a_data_stage_is_charged_the_cpu_of_children_nobody_waits_for():
    """bench/drafters.stage_data's cost: the CPU of Ray's target workers never reached getrusage (a 2-worker stage
    of an hour was charged 92 CPU seconds), so the stage samples its descendants in /proc (the control: what
    getrusage would have charged)."""
    from launch_helpers import DescendantCPU, children_cpu_s

    before = children_cpu_s()
    with DescendantCPU(period=0.05) as cpu:
        subprocess.run([sys.executable, "-c", UNWAITED], check=True, timeout=60)
    assert children_cpu_s() - before < 0.7  # the parent's own start-up only: the child's 0.8 s are lost
    assert cpu.cpu_s >= 0.7 + (children_cpu_s() - before) * 0.5
