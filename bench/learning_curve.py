"""Draft quality per CPU-hour: the servable DSpark draft for SmolLM2-135M trained on this machine, evaluated at
0.25, 0.5, 1 and 2 CPU-hours of training in our evaluator and served in llama.cpp.

    python bench/learning_curve.py [--hours 0.25 0.5 1 2] [--data DIR] [--work-dir runs/learning-curve]
    python bench/learning_curve.py --hours 0.02 0.04 --first-steps 4 --data-prompts 16 --regen-max-new 32 \
        --per-set 1 --max-new-tokens 16 --work-dir runs/learning-curve-smoke   (a smoke run, minutes)
    python bench/learning_curve.py --hours 0.25 --data default --ours-only --work-dir runs/lc-real  (one arm of a
        comparison at equal CPU-hours: real text, our evaluator only)

1. Data: the data stage of bench/drafters.py's cpu scale (400 training prompts, never an evaluation prompt) with
   the data this issue chose (DATA_RECIPE: the target's own replies sampled at T = 1, top-p 1, replies cut at the
   256-token budget kept as cut), or --data, an existing data-stage directory. Its cost is the data
   stage's and is reported apart: it is paid once per target and shared by every draft trained on it.
   --data default trains on real text instead: the embedded corpus (stdlib code + docstring chats), --real-samples
   rows read in order, which cost no data stage.
2. Training: launch/train_v4_draft.py --preset servable --single-process with RECIPE (docs/design-notes.md, "Draft
   quality per CPU-hour"), the feature cache on (data.feature_cache: the first epoch runs the target, every later
   epoch reads its features back), in segments, one per mark: a segment runs to the step the measured rate says
   the mark is reached at, exits and exports; the next one resumes its checkpoint with a larger train.max_steps.
   The learning rate therefore restarts at each segment: the resumed cosine is computed over the new total, so it
   jumps from its floor back to the value at the restored step and decays to the floor again by the segment's end
   (each mark's draft ends a decay, like a run of that length; a cosine with warm restarts, not one cosine over
   the longest budget). Each segment pays the trainer's start-up again. CPU-hours are the user +
   system CPU time of the training processes (target forwards, draft steps, start-up and checkpoints; measured with
   getrusage on the children; the trainer runs with CUDA hidden), kept in <work-dir>/curve.json across re-runs,
   an interrupted segment's included (Ctrl-C or SIGTERM reach the trainer, which checkpoints first). A segment that
   stops short of its mark by more than 2 % is followed by another. The data stage's time is printed apart.
3. At each mark: τ in our evaluator (evaluation/run.evaluate_exports: macro average over HumanEval, GSM8K and
   MT-Bench held-out prompts, greedy and T = 1); the export written for engines (deepspec), converted by
   llama.cpp's own converter and decoded greedily by llama-speculative-simple on the same prompts (τ = 1 + accepted
   / rounds per set, macro-averaged as ours; pooled over all rounds for the break-even); and llama-server's decode
   speed with the draft over the target alone, timed back to back on the same prompts (speedup_T0_engine). The
   export is served with a reduced draft vocabulary (--draft-vocab, default 4096: the commonest reply tokens of
   the data stage, serving/draft_vocab.py), which makes the draft's round in llama.cpp far cheaper. The draft is
   served at the block length (--gammas, llama.cpp's --spec-draft-n-max) and confidence threshold (--p-min,
   llama.cpp's --spec-draft-p-min: a block is cut at its first slot whose confidence is below it, so an unsure
   draft verifies fewer tokens or none) that were fastest on --per-set other prompts of each set (tuning prompts,
   never the measured ones); the speed-up with full blocks (trained γ, p-min 0) is printed beside it, and the
   draft's fixed cost: the speed when the draft runs every round but drafts nothing (a threshold no confidence
   reaches).
4. The curve as a PNG against CPU-hours and trained tokens (<work-dir>/learning_curve.png), a table, and where it
   heads (extrapolate: τ − 1 against ln CPU-h and the full-block break-even τ from the last mark's round cost;
   the tuned speed-up against ln CPU-h and where it reaches 1.0).

--ours-only skips llama.cpp (step 3's engine figures print as nan; the extrapolation fits our τ): for comparing
recipes and data at equal CPU-hours, where llama.cpp's τ follows ours (docs/design-notes.md).

Every stage is cached in --work-dir: a re-run resumes the training from its checkpoint and skips evaluated marks.
Needs llama.cpp built (python bench/llamacpp.py build). Last line:
learning_curve cpu_h=H trained_tokens=N tau_T0_ours=A tau_T0_engine=B speedup_T0_engine=S tau_T1_ours=C
(the last mark's figures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import llamacpp
from launch_helpers import children_cpu_s

REPO = Path(__file__).resolve().parents[1]
SETS = ["humaneval", "gsm8k", "mtbench"]
# The servable preset (launch/configs/servable.yaml: dspark-markov, one layer, gamma 5, context layers 2, 15, 27)
# with the settings chosen for this budget (docs/design-notes.md, "Draft quality per CPU-hour")
RECIPE = ["data.num_samples=1000000", "data.max_len=448", "data.samples_per_batch=2", "data.anchors_per_seq=32",
          "train.lr=1e-3", "train.warmup_steps=10", "train.head_lr_scale=10", "train.log_every=50",
          "checkpoint.every_steps=200", "checkpoint.keep_last=1"]
FIRST_SEGMENT_STEPS = 30  # the first segment only measures the rate (--first-steps)
# llama.cpp's confidence thresholds tried at each mark (0: full blocks): a draft whose τ is short of break-even
# can still pay where its confidence head picks the rounds and the block lengths worth verifying
P_MINS = [0.0, 0.3, 0.5, 0.7]
# llama.cpp's block lengths tried with them (--spec-draft-n-max, cut to the trained γ): a shorter block is a cheaper
# draft round (the Markov head's per-slot work) and verifies fewer tokens that would be rejected
GAMMAS = [2, 5]
# the reduced draft vocabulary the export is served with (serving/draft_vocab.py; 0: the whole vocabulary)
DRAFT_VOCAB = 4096
NO_DRAFT = 1.01  # a p-min no sigmoid confidence reaches: the draft runs every round and drafts nothing
SHORT = 0.98  # a segment ending below this share of its mark is followed by another
# the data stage's sampling when the bench makes its own data (docs/design-notes.md, items 3 and 4: T = 1 replies
# taught more acceptance than greedy ones or real text, and keeping the cut replies more again)
DATA_RECIPE = dict(regen_temperature=1.0, regen_top_p=1.0, regen_keep_unfinished=True)


def log(msg: str) -> None:
    print(f"[learning_curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def metrics(run_dir: Path) -> list[dict]:
    from pipeline.metrics import read_jsonl_metrics

    path = run_dir / "metrics.jsonl"
    return [r for _, r in sorted(read_jsonl_metrics(path).items())] if path.is_file() else []


def latest_step(run_dir: Path) -> int:
    """The step of the run's latest committed checkpoint (0: none), what the next segment resumes from."""
    from workers.trainer.checkpoint import CheckpointManager

    path = CheckpointManager(run_dir).latest() if (run_dir / "checkpoints").is_dir() else None
    return json.loads((Path(path) / "meta.json").read_text())["step"] if path is not None else 0


def train_segment(run_dir: Path, data: Path, cache: Path, max_steps: int, overrides: list[str], state: dict,
                  save) -> None:
    """Train (or resume) to `max_steps` on the CPU, adding the segment's CPU seconds to state["cpu_s"] however it
    ends: an interrupt (Ctrl-C, SIGTERM to this script) is passed on to the trainer, which checkpoints at its next
    step and exits, and the CPU it spent is counted before this script stops."""
    cmd = [sys.executable, str(REPO / "launch" / "train_v4_draft.py"), "--preset", "servable", "--single-process",
           "--run-dir", str(run_dir), "--max-steps", str(max_steps), f"data.source={data}",
           f"data.feature_cache={cache}", *RECIPE, *overrides]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # CPU-hours: the trainer must not find a GPU
    before = children_cpu_s()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    try:
        try:
            rc = proc.wait()
        except KeyboardInterrupt:  # the trainer got the same SIGINT (same process group): let it checkpoint
            log("interrupted: waiting for the trainer to checkpoint (a second Ctrl-C stops it at once)")
            try:
                rc = proc.wait()
            except KeyboardInterrupt:
                proc.kill()
                rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
        state["cpu_s"] += children_cpu_s() - before
        save()
    if rc != 0:
        sys.exit(f"error: training stopped with exit status {rc} ({state['cpu_s'] / 3600:.3f} CPU-h counted; "
                 f"re-run the same command to resume)")


def train_to(state: dict, mark_h: float, run_dir: Path, data: Path, cache: Path, overrides: list[str], save) -> None:
    """Segments until the training's CPU time reaches `mark_h` CPU-hours (within SHORT)."""
    while state["cpu_s"] < SHORT * mark_h * 3600:
        done = latest_step(run_dir)
        if done != state["steps"]:
            log(f"the run's latest checkpoint is step {done}, curve.json says {state['steps']}: resuming from step "
                f"{done} (CPU time of a segment that was killed outright is not in the count)")
        if done == 0:
            target = state["first_steps"]
        else:
            rate = state["last_rate"]  # steps per CPU second of the last segment (the cached epochs are faster)
            target = done + max(1, round(rate * (mark_h * 3600 - state["cpu_s"])))
        t0, cpu0 = time.time(), state["cpu_s"]
        train_segment(run_dir, data, cache, target, overrides, state, save)
        steps = latest_step(run_dir)
        cpu = state["cpu_s"] - cpu0
        state["last_rate"] = max(steps - done, 1) / max(cpu, 1e-9)
        state["steps"] = steps
        save()
        rows = metrics(run_dir)
        tau = rows[-1].get("tau_est", float("nan")) if rows else float("nan")
        log(f"trained to step {steps}: {state['cpu_s'] / 3600:.3f} CPU-h ({cpu:.0f} CPU-s in {time.time() - t0:.0f} s"
            f" wall), tau_est {tau:.3f}")


def engine_eval(export: Path, work: Path, items, tune_items, max_new: int, threads: int, p_mins: list[float],
                gammas: list[int], draft_vocab=None) -> dict:
    """`export` served by llama.cpp: greedy τ per set and their macro average (as our evaluator averages), τ over
    all rounds pooled (what the speed sees), and llama-server's decode speed with and without the draft. The draft
    is served at the confidence threshold (llama.cpp's --spec-draft-p-min) of `p_mins` that gave the highest speed-up
    on `tune_items` (prompts disjoint from `items`), so the reported speed-up was not picked on the prompts that
    measure it; τ is measured with full blocks (p-min 0), the blocks our evaluator drafts. With several `gammas`
    (llama.cpp's --spec-draft-n-max, at most the trained block) the block length is tuned with the threshold.
    `draft_vocab`: (ids_N, lm_head_VD), the reduced draft vocabulary the export is written with."""
    from serve_llamacpp import engine_rounds, rounds_tau, server_speeds

    from serving.engine_export import target_facts, write_engine_export
    from workers.frozen_target.model import resolve_target_path

    target_dir = resolve_target_path("smollm2")
    deepspec = write_engine_export(export, "deepspec", work / "deepspec", target_facts(target_dir, "smollm2"),
                                   draft_vocab=draft_vocab)
    gamma = json.loads((deepspec / "config.json").read_text())["block_size"]
    target_gguf = llamacpp.target_gguf("smollm2")
    draft_gguf = llamacpp.convert(deepspec, work / "draft.gguf", target_dir)
    rounds = engine_rounds(target_gguf, draft_gguf, items, 0.0, max_new, gamma, threads)
    by_set = {ds: rounds_tau([r for (name, _, _), r in zip(items, rounds, strict=True) if name == ds])
              for ds in dict.fromkeys(name for name, _, _ in items)}
    grid = [(min(g, gamma), p) for g in dict.fromkeys(gammas) for p in p_mins]
    tuning = {}
    if len(grid) > 1:  # every configuration and the target alone served side by side, prompt by prompt
        tok_s = server_speeds(target_gguf, {"alone": None, **{f"{g}:{p:g}": (draft_gguf, g, p) for g, p in grid}},
                              tune_items, 0.0, max_new, threads)
        tuning = {k: v / tok_s["alone"] for k, v in tok_s.items() if k != "alone"}
        log("γ:p-min tuning (speed-up on the tuning prompts): "
            + ", ".join(f"{k} {v:.3f}" for k, v in tuning.items()))
    n_max, p_min = grid[0]
    if tuning:
        best = max(tuning, key=tuning.get).split(":")
        n_max, p_min = int(best[0]), float(best[1])
    configs = {"alone": None, "full": (draft_gguf, gamma, 0.0), "spec": (draft_gguf, n_max, p_min),
               # the draft's fixed cost: it runs every round, but no confidence reaches NO_DRAFT, so nothing is
               # verified
               "idle": (draft_gguf, n_max, NO_DRAFT)}
    if (n_max, p_min) == (gamma, 0.0):
        del configs["spec"]
    tok_s = server_speeds(target_gguf, configs, items, 0.0, max_new, threads)
    base, full, idle = tok_s["alone"], tok_s["full"], tok_s["idle"]
    spec = tok_s.get("spec", full)
    return {"tau_T0_engine": sum(by_set.values()) / len(by_set), "tau_T0_engine_sets": by_set,
            "tau_T0_engine_pooled": rounds_tau(rounds), "speedup_T0_engine": spec / base,
            "speedup_T0_engine_full": full / base, "speedup_T0_engine_idle": idle / base, "tok_s_alone": base,
            "tok_s_draft": spec, "p_min": p_min, "n_max": n_max, "p_min_tuning": tuning}


def evaluate_mark(name: str, export: Path, work: Path, per_set: int, max_new: int, threads: int, items, tune_items,
                  p_mins: list[float], gammas: list[int], engine: bool, draft_vocab=None) -> dict:
    import logging

    from evaluation.report import tau_table
    from evaluation.run import evaluate_exports

    results = evaluate_exports({name: export}, "smollm2", SETS, per_set, max_new, [0.0, 1.0], work / "eval", "cpu",
                               logging.getLogger("learning_curve"))
    _, macro = tau_table(results)
    ours = {"tau_T0_ours": macro[(name, 0.0)], "tau_T1_ours": macro[(name, 1.0)]}
    if not engine:
        return {**ours, "tau_T0_engine": float("nan"), "speedup_T0_engine": float("nan")}
    return {**ours, **engine_eval(export, work, items, tune_items, max_new, threads, p_mins, gammas, draft_vocab)}


def extrapolate(points: list[dict]) -> str:
    """Where the curve heads, in two lines.
    1. τ_T0_engine - 1 fitted as a·ln(CPU-h) + b over the marks, and the CPU-hours at which it reaches break-even
       with full blocks, the τ at which a round (draft + verification) costs what τ tokens of the target alone do:
       pooled τ_engine / full-block speed-up at the last mark (that mark's round cost, in target-alone tokens).
    2. The reported speed-up itself (γ and p-min tuned at each mark) fitted the same way, and where it reaches 1.0:
       the confidence threshold skips the rounds least likely to pay, so it breaks even below the full-block τ.
    Without engine figures (--ours-only): the fit of τ_T0_ours, and no break-even."""
    import math

    import numpy as np

    xs = [math.log(p["cpu_h"]) for p in points]
    if len(set(xs)) < 2:
        return "extrapolation: needs two marks or more"
    last = points[-1]
    if "tau_T0_engine_pooled" not in last:
        a, b = np.polyfit(xs, [p["tau_T0_ours"] - 1 for p in points], 1)
        return (f"extrapolation: tau_T0_ours - 1 = {a:.4f} ln(cpu_h) + {b:.4f} over {len(points)} marks (no engine "
                f"figures: no break-even)")

    past = last["speedup_T0_engine"] > 1

    def reached(a: float, b: float, goal: float) -> str:
        if past:
            return "already past it"
        if a <= 0:
            return "no rising trend to extrapolate"
        log10_h = (goal - b) / a / math.log(10)  # in log space: a nearly flat fit overflows exp()
        hours = f" ({10 ** log10_h:.3g} CPU-h)" if log10_h < 6 else ""
        return f"reached at about 10^{log10_h:.1f} CPU-h{hours} if the trend held"

    a, b = np.polyfit(xs, [p["tau_T0_engine"] - 1 for p in points], 1)
    breakeven = last["tau_T0_engine_pooled"] / last["speedup_T0_engine_full"]
    tau_line = (f"extrapolation: tau_T0_engine - 1 = {a:.4f} ln(cpu_h) + {b:.4f} over {len(points)} marks; break-even "
                f"tau {breakeven:.2f} (a round of full blocks costs {breakeven:.2f} target-alone tokens at the last "
                f"mark); " + reached(a, b, breakeven - 1))
    a, b = np.polyfit(xs, [p["speedup_T0_engine"] for p in points], 1)
    speed_line = (f"extrapolation: speedup_T0_engine = {a:.4f} ln(cpu_h) + {b:.4f} over {len(points)} marks (γ and "
                  f"p-min tuned at each mark); 1.0 " + reached(a, b, 1.0))
    return tau_line + "\n" + speed_line


def plot(points: list[dict], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "cpu_h", "training CPU-hours"), (axes[1], "trained_tokens", "trained tokens")):
        x = [p[key] for p in points]
        for field, style in (("tau_T0_ours", "o-"), ("tau_T0_engine", "s--"), ("tau_T1_ours", "^-")):
            if any(p[field] != p[field] for p in points):  # nan: not measured (--ours-only)
                continue
            ax.plot(x, [p[field] for p in points], style, label=field)
        ax.set_xscale("log")
        # ticks at the marks: a span under a decade has no major log tick, and matplotlib labels every minor one
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(x, [f"{v:.3g}" if key == "cpu_h" else f"{v / 1e3:,.0f}k" for v in x])
        ax.set_xlabel(label)
        ax.set_ylabel("τ (tokens per round)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("servable DSpark draft for SmolLM2-135M, trained on this CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hours", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="training CPU-hour marks")
    p.add_argument("--data", default=None, help="a data-stage directory (default: bench/drafters.py's, made here), "
                   "or 'default': real text, the embedded corpus")
    p.add_argument("--real-samples", type=int, default=4096,
                   help="with --data default: rows of real text, read in order (default %(default)s)")
    p.add_argument("--ours-only", action="store_true", help="evaluate in our evaluator only (no llama.cpp)")
    p.add_argument("--data-prompts", type=int, default=None,
                   help="training prompts the data stage regenerates (default: bench/drafters.py's cpu scale, 400)")
    p.add_argument("--regen-max-new", type=int, default=None, help="the data stage's reply budget (default 256)")
    p.add_argument("--regen-temperature", type=float, default=DATA_RECIPE["regen_temperature"],
                   help="the data stage's sampling temperature, 0 = greedy (default %(default)s)")
    p.add_argument("--regen-top-p", type=float, default=DATA_RECIPE["regen_top_p"],
                   help="the data stage's top-p (default %(default)s)")
    p.add_argument("--regen-drop-unfinished", action="store_true",
                   help="the data stage drops replies cut at its reply budget (default: keeps them as cut)")
    p.add_argument("--regen-batch", type=int, default=None,
                   help="prompts per generate call, in one process on all cores instead of bench/drafters.py's 2 "
                        "Ray workers at 8 (64: 2.5x the tokens per second of 8 on 2 cores)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="run-config overrides after RECIPE (a recipe experiment), e.g. train.lr=2e-3")
    p.add_argument("--work-dir", default=str(REPO / "runs" / "learning-curve"))
    p.add_argument("--per-set", type=int, default=4, help="held-out prompts per set (HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--p-min", type=float, nargs="+", default=P_MINS, metavar="P",
                   help="llama.cpp's DSpark confidence thresholds (--spec-draft-p-min) to serve at; with several, the "
                        "fastest on --per-set tuning prompts per set (after the evaluation prompts) is used "
                        "(default %(default)s; 0: full blocks)")
    p.add_argument("--gammas", type=int, nargs="+", default=GAMMAS, metavar="G",
                   help="llama.cpp's block lengths (--spec-draft-n-max, at most the trained γ) to serve at, tuned "
                        "with --p-min on the tuning prompts (default %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, metavar="N",
                   help="serve the draft with a reduced vocabulary: the N commonest reply tokens of the data stage "
                        "(serving/draft_vocab.py; 0: the target's whole vocabulary; default %(default)s)")
    p.add_argument("--first-steps", type=int, default=FIRST_SEGMENT_STEPS,
                   help="steps of the first segment, which measures the rate (default %(default)s)")
    args = p.parse_args(argv)
    marks = sorted(args.hours)
    if marks[0] <= 0:
        sys.exit(f"error: --hours must be positive, got {marks[0]}")
    if not all(0 <= v <= 1 for v in args.p_min):
        sys.exit(f"error: --p-min takes confidences in [0, 1], got {args.p_min}")
    if not all(g >= 1 for g in args.gammas):
        sys.exit(f"error: --gammas takes block lengths of at least 1, got {args.gammas}")
    if args.draft_vocab < 0:
        sys.exit(f"error: --draft-vocab must be 0 (the whole vocabulary) or positive, got {args.draft_vocab}")
    if args.data == "default" and args.draft_vocab and not args.ours_only:
        sys.exit("error: --draft-vocab chooses its tokens from a data stage's replies; with --data default pass "
                 "--draft-vocab 0")
    for b in ("llama-server", "llama-speculative-simple") if not args.ours_only else ():
        if not llamacpp.binary(b).is_file():
            sys.exit(f"error: {llamacpp.binary(b)} not built (python bench/llamacpp.py build)")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    overrides = list(args.set)
    if args.data == "default":
        data = args.data
        overrides = [f"data.num_samples={args.real_samples}", *overrides]
    elif args.data:
        data = Path(args.data)
        if not (data / "progress.json").is_file():
            sys.exit(f"error: --data {data} is not a data-stage directory (no progress.json)")
    else:
        import logging

        from drafters import SCALES, stage_data

        logging.basicConfig(level=logging.INFO, format="%(message)s")
        scale = dict(SCALES["cpu"])
        if args.data_prompts is not None:
            scale["train_prompts"] = args.data_prompts
            scale["regen_ray"] = args.data_prompts >= 64  # Ray's start costs more than it saves on a few prompts
        if args.regen_max_new is not None:
            scale["regen_max_new"] = args.regen_max_new
        scale["regen_temperature"], scale["regen_top_p"] = args.regen_temperature, args.regen_top_p
        scale["regen_keep_unfinished"] = not args.regen_drop_unfinished
        if args.regen_batch is not None:
            scale["regen_batch"], scale["regen_ray"] = args.regen_batch, False
        data = stage_data(work, scale, logging.getLogger("learning_curve"))
    if data != "default" and (data / "bench_wall.json").is_file():
        cost = json.loads((data / "bench_wall.json").read_text())
        cpu = f", {cost['cpu_seconds'] / 3600:.2f} CPU-h" if "cpu_seconds" in cost else ""
        log(f"data stage {data}: {cost['seconds'] / 60:.0f} min wall{cpu} (paid once per target, shared by every draft "
            f"trained on it; not in the CPU-hours below)")
    # what the points depend on besides the training: a re-run with other settings would mix two curves
    settings = {"data": data if data == "default" else str(data.resolve()), "set": overrides,
                "per_set": args.per_set, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
                "p_min": args.p_min, "gammas": args.gammas, "draft_vocab": args.draft_vocab, "recipe": RECIPE,
                "engine": not args.ours_only}
    state_path = work / "curve.json"
    state = (json.loads(state_path.read_text()) if state_path.is_file() else
             {"cpu_s": 0.0, "steps": 0, "points": {}, "settings": settings, "first_steps": args.first_steps})
    if state["settings"] != settings:
        sys.exit(f"error: {state_path} was made with other settings ({state['settings']}); use another --work-dir")

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(state_path)

    from serve_llamacpp import prompts

    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    tokenizer = load_tokenizer(resolve_target_path("smollm2"))
    items = prompts(args.per_set, tokenizer)
    tune_items = prompts(args.per_set, tokenizer, skip=args.per_set)
    draft_vocab = None
    if args.draft_vocab and not args.ours_only:
        from serving.draft_vocab import draft_vocab_from_data

        ids_N, lm_head_VD, covered = draft_vocab_from_data(resolve_target_path("smollm2"), data, args.draft_vocab)
        draft_vocab = (ids_N, lm_head_VD)
        log(f"draft vocabulary: {covered}")
    run_dir = work / "run"
    for h in marks:
        key = f"{h:g}"
        if key in state["points"]:
            log(f"mark {key} CPU-h: cached")
            continue
        if state["cpu_s"] > 1.1 * h * 3600:
            sys.exit(f"error: --hours {key}: the run is already at {state['cpu_s'] / 3600:.3f} CPU-h (a mark can only "
                     f"be added past the last one; use another --work-dir for a new curve)")
        train_to(state, h, run_dir, data, work / "feature-cache", overrides, save)
        mark_dir = work / "marks" / key
        if mark_dir.exists():
            shutil.rmtree(mark_dir)
        mark_dir.mkdir(parents=True)
        export = shutil.copytree(run_dir / "export", mark_dir / "export")
        rows = metrics(run_dir)
        point = {"cpu_h": state["cpu_s"] / 3600, "steps": state["steps"],
                 "trained_tokens": int(sum(r.get("trained_tokens", 0) for r in rows))}
        log(f"mark {key}: evaluating the draft at step {point['steps']} ({point['cpu_h']:.3f} CPU-h)")
        t0 = time.time()
        point.update(evaluate_mark(f"h{key}", export, mark_dir, args.per_set, args.max_new_tokens, args.threads,
                                   items, tune_items, args.p_min, args.gammas, not args.ours_only, draft_vocab))
        log(f"mark {key}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in point.items()})
            + f" ({time.time() - t0:.0f} s)")
        state["points"][key] = point
        save()
    points = [state["points"][f"{h:g}"] for h in marks]
    plot(points, work / "learning_curve.png")
    print(f"{'CPU-h':>7}{'steps':>7}{'tokens':>10}{'τ T0 ours':>11}{'τ T0 llama':>12}{'no draft':>10}"
          f"{'full blocks':>13}{'γ':>3}{'p-min':>7}{'speed-up':>10}{'over no draft':>15}{'τ T1 ours':>11}")
    nan = float("nan")
    for pt in points:
        print(f"{pt['cpu_h']:>7.3f}{pt['steps']:>7}{pt['trained_tokens']:>10}{pt['tau_T0_ours']:>11.3f}"
              f"{pt['tau_T0_engine']:>12.3f}{pt.get('speedup_T0_engine_idle', nan):>10.3f}"
              f"{pt.get('speedup_T0_engine_full', nan):>13.3f}{pt.get('n_max', 5):>3}{pt.get('p_min', nan):>7.2f}"
              f"{pt['speedup_T0_engine']:>10.3f}"
              f"{pt['speedup_T0_engine'] / pt.get('speedup_T0_engine_idle', nan):>15.3f}{pt['tau_T1_ours']:>11.3f}")
    print("(llama-server with the draft over the target alone, greedy. speed-up: at the γ and p-min picked on the "
          "tuning prompts; full blocks: trained γ at p-min 0; no draft: the draft runs every round at the picked γ "
          "and drafts nothing, its fixed cost; over no draft: speed-up / no draft, what the accepted tokens gain, "
          "steadier than either when the target's own speed drifts between marks)")
    print(extrapolate(points))
    last = points[-1]
    print(f"learning_curve cpu_h={last['cpu_h']:.3f} trained_tokens={last['trained_tokens']} "
          f"tau_T0_ours={last['tau_T0_ours']:.3f} tau_T0_engine={last['tau_T0_engine']:.3f} "
          f"speedup_T0_engine={last['speedup_T0_engine']:.3f} tau_T1_ours={last['tau_T1_ours']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
