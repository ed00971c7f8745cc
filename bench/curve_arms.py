"""Arms at equal training CPU-hours: the servable draft trained by bench/learning_curve.py (--ours-only) on other
data or with another recipe, each for the same CPU-hours, evaluated greedy and at T = 1 in our evaluator on the
same held-out prompts, side by side (issue #25 items 3 and 4: which data, which recipe).

    python bench/curve_arms.py --hours 0.25 --per-set 8 --work-dir runs/arms \
        --arm greedy runs/data-greedy-600/data --arm t1 runs/data-t1-600/data --arm real default
    python bench/curve_arms.py --hours 0.25 --work-dir runs/arms-recipe \
        --arm base runs/data-greedy-2400/data --arm lr3e-3 runs/data-greedy-2400/data train.lr=3e-3
    python bench/curve_arms.py --hours 0.01 --per-set 1 --max-new-tokens 8 --first-steps 2 \
        --work-dir runs/arms-smoke --arm a default --arm b default train.lr=3e-3     (a smoke run, minutes)

An arm is `--arm NAME DATA [KEY=VALUE ...]`: DATA is a data-stage directory or `default` (real text, the embedded
corpus), the KEY=VALUEs are run-config overrides after learning_curve's RECIPE. Each arm trains in its own
<work-dir>/<NAME> (its own feature cache, so every arm pays its own target forwards), one after another: run this
alone, since the arms are compared at equal CPU time. A re-run reuses finished arms (learning_curve caches its
marks). The first arm is the reference of the ratios. Last line:
curve_arms cpu_h=H best_T0=NAME tau_T0=A gain_vs_first_T0=R best_T1=NAME tau_T1=B gain_vs_first_T1=Q
(gain: the best arm's τ − 1 over the first arm's)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_arm(name: str, data: str, overrides: list[str], args: argparse.Namespace) -> dict:
    """Train and evaluate one arm through learning_curve (a subprocess: each arm's evaluator and target are freed
    before the next), and return its point at the mark."""
    work = Path(args.work_dir) / name
    cmd = [sys.executable, str(REPO / "bench" / "learning_curve.py"), *([] if args.engine else ["--ours-only"]),
           "--hours", f"{args.hours:g}", "--data", data, "--per-set", str(args.per_set),
           "--max-new-tokens", str(args.max_new_tokens), "--first-steps", str(args.first_steps),
           "--work-dir", str(work)]
    if overrides:
        cmd += ["--set", *overrides]
    print(f"[curve_arms] arm {name}: {' '.join(cmd[1:])}", flush=True)
    res = subprocess.run(cmd, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"error: arm {name} failed (exit status {res.returncode}); re-run the same command to resume it")
    state = json.loads((work / "curve.json").read_text())
    return state["points"][f"{args.hours:g}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arm", nargs="+", action="append", required=True, metavar="NAME DATA [KEY=VALUE]",
                   help="an arm: its name, its data (a data-stage directory or 'default'), run-config overrides")
    p.add_argument("--hours", type=float, default=0.25, help="training CPU-hours of every arm")
    p.add_argument("--per-set", type=int, default=8, help="held-out prompts per set (HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--first-steps", type=int, default=30, help="learning_curve's rate-measuring first segment")
    p.add_argument("--work-dir", default=str(REPO / "runs" / "curve-arms"))
    p.add_argument("--engine", action="store_true",
                   help="also serve every arm in llama.cpp (greedy τ and llama-server's speed-up over the target "
                        "alone; needs python bench/llamacpp.py build): for arms whose cost per round differs (γ)")
    args = p.parse_args(argv)
    arms = []
    for spec in args.arm:
        if len(spec) < 2:
            sys.exit(f"error: --arm {' '.join(spec)}: give a name and a data source (a data-stage directory or "
                     "'default')")
        name, data, overrides = spec[0], spec[1], spec[2:]
        if "/" in name or name in {a[0] for a in arms}:
            sys.exit(f"error: --arm {name}: arm names must be unique and hold no '/'")
        bad = [o for o in overrides if "=" not in o]
        if bad:
            sys.exit(f"error: --arm {name}: overrides are KEY=VALUE, got {bad[0]!r}")
        if data != "default" and not (Path(data) / "progress.json").is_file():
            sys.exit(f"error: --arm {name}: {data} is not a data-stage directory (no progress.json) nor 'default'")
        arms.append((name, data, overrides))
    points = {name: run_arm(name, data, overrides, args) for name, data, overrides in arms}
    engine = f"{'τ T0 llama':>11}{'speed-up':>10}" if args.engine else ""
    print(f"{'arm':<14}{'CPU-h':>7}{'steps':>7}{'tokens':>10}{'τ T0':>8}{'τ T1':>8}{engine}  data, overrides")
    for name, data, overrides in arms:
        pt = points[name]
        engine = f"{pt['tau_T0_engine']:>11.3f}{pt['speedup_T0_engine']:>10.3f}" if args.engine else ""
        print(f"{name:<14}{pt['cpu_h']:>7.3f}{pt['steps']:>7}{pt['trained_tokens']:>10}{pt['tau_T0_ours']:>8.3f}"
              f"{pt['tau_T1_ours']:>8.3f}{engine}  {data} {' '.join(overrides)}")
    first = points[arms[0][0]]
    parts = [f"curve_arms cpu_h={args.hours:g}"]
    for key, label in (("tau_T0_ours", "T0"), ("tau_T1_ours", "T1")):
        best = max(points, key=lambda n: points[n][key])
        ratio = (points[best][key] - 1) / (first[key] - 1) if first[key] > 1 else float("nan")
        parts.append(f"best_{label}={best} tau_{label}={points[best][key]:.3f} gain_vs_first_{label}={ratio:.2f}")
    print(" ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
