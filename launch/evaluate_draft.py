"""Evaluate trained drafts by real speculative decoding against their target: τ, per-position acceptance, ECE.

    python launch/evaluate_draft.py --draft runs/tiny/export [--draft other=runs/x/export ...] \
        --target smollm2 --datasets humaneval gsm8k mtbench --num-prompts 10 --max-new-tokens 64 \
        --temperatures 1.0 0.0 --out runs/tiny/eval
    python launch/evaluate_draft.py --draft runs/tiny/export --prompts held_out.jsonl --out runs/tiny/eval-mine
    python launch/evaluate_draft.py --draft runs/tiny/export          # --out defaults to runs/tiny/eval

--datasets names built-in sets (evaluation/prompts.py); --prompts adds prompt files (.jsonl/.parquet of chats or
texts), each a dataset named by its file stem (given alone, only the files are evaluated). An export holding
calibration.json (launch/calibrate_draft.py) is evaluated with calibrated confidences.

Progress, per decoded prompt: prompts done of the total, τ so far, tokens/s and the time left (a bar on a terminal,
plain log lines otherwise). The defaults (10 prompts from each of 3 sets, 64 new tokens, T = 1 and 0: 60 decodes)
took about 6 minutes on an idle 2-core CPU with the tiny run's draft on SmolLM2; --num-prompts 3 (18 decodes) gives
a first look in about 2 (docs/evaluation.md).

Writes report.json, report.md and acceptance.png under --out (evaluation/report.py) and prints the τ table, and
per (draft, temperature) NAME-T{T}.rounds.parquet, the recorded rounds (evaluation/rounds.py: per-round raw
confidence logits, accepted count n, draft time), which serving/simulator.py replays.
Each (draft, temperature) result is cached in --out, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from evaluation.report import speedup_table, tau_table
    from evaluation.run import evaluate_exports
    from pipeline.metrics import get_logger

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", action="append", required=True,
                   help="an exported draft directory, optionally NAME=DIR (repeat for several)")
    p.add_argument("--target", default="smollm2", help="target name or path (as target.path in the run config)")
    p.add_argument("--datasets", nargs="+", default=None,
                   help="built-in prompt sets (default: humaneval gsm8k mtbench, unless --prompts is given)")
    p.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                   help="prompt files (.jsonl/.parquet), each evaluated as a dataset named by its stem")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--device", default="auto")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop starting prompts after this long, for every draft alike (default: no limit)")
    p.add_argument("--autoregressive", action="store_true",
                   help="also decode with the target alone and print each draft's end-to-end speed-up over it")
    p.add_argument("--out", help="directory for the report and the recorded rounds (default: eval beside the first "
                                 "draft, e.g. runs/tiny/eval for runs/tiny/export)")
    args = p.parse_args(argv)
    exports = {}
    for item in args.draft:
        name, _, path = item.rpartition("=")
        path = Path(path)
        exports[name or path.parent.name] = path
    out = Path(args.out) if args.out else next(iter(exports.values())).parent / "eval"
    try:
        datasets = (args.datasets or ([] if args.prompts else ["humaneval", "gsm8k", "mtbench"])) + args.prompts
        results = evaluate_exports(exports, args.target, datasets, args.num_prompts, args.max_new_tokens,
                                   args.temperatures, out, args.device, get_logger("dspark.eval"),
                                   args.time_limit, args.autoregressive)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tau_table(results)[0])
    print(f"report: {out / 'report.md'}")
    if args.autoregressive:
        print("\nend-to-end speed-up over the target alone (tokens/s ratio on the same prompts)")
        print(speedup_table(results)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
