"""Calibrate an exported draft's confidence head by sequential temperature scaling (STS) on real decoding rounds.

    python launch/calibrate_draft.py --draft runs/tiny/export --target smollm2 --prompts held_out.jsonl \
        [--prompts gsm8k mtbench] [--num-prompts 40] [--max-new-tokens 64] [--temperature 1.0] \
        [--fit-fraction 0.5] --out runs/tiny/calib

Decodes the prompts at --temperature recording every round (<out>/rounds.parquet), splits each set's prompts
into --fit-fraction to fit on and the rest held out, fits STS (per-position temperatures, applied by every later
load of the export) and one temperature for every position (folded into the confidence head of the engine
exports, the calibration vLLM can run) on the fit rounds into <draft>/calibration.json, and reports per-position
ECE and ROC-AUC of the survival before, after STS and under the one temperature, on the held-out rounds only:
printed, in <out>/calibration_report.json and <out>/reliability.png. The steps are evaluation/calibrate.py's.
Prompts are built-in sets (humaneval, gsm8k, mtbench) or files (.jsonl/.parquet of chats or texts; see
evaluation/prompts.py). Exit status 2 with one line for bad input (missing export, unreadable or empty prompt
file, bad temperature, a draft without a confidence head).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from evaluation.calibrate import calibrate, report_table
    from evaluation.report import json_safe
    from pipeline.metrics import get_logger

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", required=True, help="an exported draft directory (calibration.json goes into it)")
    p.add_argument("--target", default="smollm2", help="target name or path (as target.path in the run config)")
    p.add_argument("--prompts", nargs="+", action="extend", required=True, metavar="FILE|SET",
                   help="prompt files (.jsonl/.parquet) or built-in sets (humaneval gsm8k mtbench)")
    p.add_argument("--num-prompts", type=int, default=40, help="at most this many prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="decoding temperature (0 = greedy)")
    p.add_argument("--fit-fraction", type=float, default=0.5, help="share of each set's prompts fitted on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="directory for rounds.parquet, the report and reliability.png")
    args = p.parse_args(argv)
    try:
        rep = calibrate(Path(args.draft), args.target, args.prompts, args.num_prompts, args.max_new_tokens,
                        args.temperature, Path(args.out), args.fit_fraction, args.seed, args.device,
                        get_logger("dspark.calibrate"))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"STS fitted on {rep['fit_rounds']} rounds; ECE / ROC-AUC of the survival on {rep['num_rounds']} "
          f"held-out rounds (other prompts):")
    print(report_table(rep))
    print(json.dumps(json_safe({k: rep[k] for k in ("temperatures", "single_temperature", "ece_before", "ece_after",
                                                    "ece_single", "roc_auc_before",
                                                    "roc_auc_after")})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
