"""Bytes per trained token that the trainers actually receive, vs what shipping the target's logits would cost.

Runs the real pipeline (launch/train_v4_draft.py, `tiny` preset: SmolLM2-135M over real text, local Ray, CPU) for a
few steps and reads the trainers' own byte counters (payload of every FeatureBatch they received, all ranks) from
metrics.jsonl. The logits alternative ships one bf16 vector of V entries per trained token (V * 2 bytes); a
logits-based pipeline would in fact ship them for every token the target ran, so this is its lower bound.

Run: python bench/transport.py [--steps 6] [extra dotted overrides...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.metrics import read_jsonl_metrics

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()  # flags and dotted overrides in any order
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, str(REPO / "launch" / "train_v4_draft.py"), "--run-dir", str(run_dir),
               "--max-steps", str(args.steps), "checkpoint.export=false", "train.tensorboard=false", *args.overrides]
        print("running:", " ".join(cmd[1:]), flush=True)
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"pipeline run failed:\n{res.stderr[-3000:]}")
        cfg = (run_dir / "config.yaml").read_text()
        records = read_jsonl_metrics(run_dir / "metrics.jsonl")
    import yaml

    resolved = yaml.safe_load(cfg)
    vocab, hidden = resolved["draft"]["vocab_size"], resolved["draft"]["hidden_size"]
    wire = sum(r["bytes_per_token"] * r["trained_tokens"] for r in records.values())
    trained = sum(r["trained_tokens"] for r in records.values())
    per_token = wire / trained
    logits = vocab * 2
    print(f"target {resolved['target']['path']}: vocab {vocab}, hidden {hidden}, wire dtype "
          f"{resolved['target']['wire_dtype']}, context layers {resolved['draft']['target_layers']}")
    print(f"{'':34}{'bytes / trained token':>22}")
    print(f"{'hidden states (measured)':34}{per_token:>22.1f}")
    print(f"{'full logits, bf16 (V*2)':34}{logits:>22.1f}")
    print(f"steps {len(records)}, trained tokens {trained:.0f}, bytes received {wire:.0f}")
    print(f"bytes_per_trained_token hidden={per_token:.1f} logits={logits} "
          f"ratio logits/hidden={logits / per_token:.1f}x")


if __name__ == "__main__":
    main()
