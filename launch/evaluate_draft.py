"""Evaluate trained drafts by real speculative decoding against their target: τ, per-position acceptance, ECE.

    python launch/evaluate_draft.py --draft runs/tiny/export [--draft other=runs/x/export ...] \
        --target smollm2 --datasets humaneval gsm8k mtbench --num-prompts 10 --max-new-tokens 64 \
        --temperatures 1.0 0.0 --out runs/tiny/eval

Writes report.json, report.md and acceptance.png under --out (pipeline/report.py) and prints the τ table.
Each (draft, temperature) result is cached in --out, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def evaluate_exports(exports: dict[str, Path], target_name: str, datasets: list[str], num_prompts: int,
                     max_new_tokens: int, temperatures: list[float], out_dir: Path, device: str = "auto",
                     log=None) -> list[dict]:
    import torch

    from pipeline.evaluate import evaluate, make_drafter
    from pipeline.prompt_sets import EVAL_SETS
    from pipeline.report import write_report
    from pipeline.target_model import embedding_weights, load_target, resolve_target_path
    from workers.checkpoint import load_exported_draft

    unknown = sorted(set(datasets) - set(EVAL_SETS))
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; available: {sorted(EVAL_SETS)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, tok = load_target(resolve_target_path(target_name), dtype=dtype)
    target.to(device)
    prompts = {ds: EVAL_SETS[ds](num_prompts) for ds in datasets}
    results = []
    for name, export in exports.items():
        drafter = make_drafter(load_exported_draft(export, *embedding_weights(target)).to(device), name)
        for temperature in temperatures:
            cache = out_dir / f"{name}-T{temperature}.json"
            if cache.is_file():
                res = json.loads(cache.read_text())
            else:
                t0 = time.time()
                res = evaluate(target, tok, drafter, prompts, temperature, max_new_tokens, seed=0)
                cache.parent.mkdir(parents=True, exist_ok=True)
                cache.write_text(json.dumps(res))
                if log is not None:
                    log.info("eval %s T=%.1f: %.0f s, tau %s", name, temperature, time.time() - t0,
                             {ds: round(m["tau"], 3) for ds, m in res["datasets"].items()})
            results.append(res)
    write_report(results, out_dir)
    return results


def tau_table(results: list[dict]) -> tuple[str, dict[tuple[str, float], float]]:
    """A text table of τ per dataset and the macro average, and the macro averages by (drafter, temperature)."""
    taus = {(r["drafter"], r["temperature"]): {ds: m["tau"] for ds, m in r["datasets"].items()} for r in results}
    datasets = sorted(next(iter(taus.values())))
    lines = [f"{'drafter':10}{'T':>5}" + "".join(f"{ds:>11}" for ds in datasets) + f"{'macro':>9}"]
    macro = {}
    for (name, temperature), row in sorted(taus.items()):
        macro[(name, temperature)] = sum(row.values()) / len(row)
        lines.append(f"{name:10}{temperature:>5.1f}" + "".join(f"{row[ds]:>11.3f}" for ds in datasets)
                     + f"{macro[(name, temperature)]:>9.3f}")
    return "\n".join(lines), macro


def main(argv: list[str] | None = None) -> int:
    from pipeline.metrics import get_logger

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--draft", action="append", required=True,
                   help="an exported draft directory, optionally NAME=DIR (repeat for several)")
    p.add_argument("--target", default="smollm2", help="target name or path (as target.path in the run config)")
    p.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k", "mtbench"])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    exports = {}
    for item in args.draft:
        name, _, path = item.rpartition("=")
        path = Path(path)
        exports[name or path.parent.name] = path
    try:
        results = evaluate_exports(exports, args.target, args.datasets, args.num_prompts, args.max_new_tokens,
                                   args.temperatures, Path(args.out), args.device, get_logger("dspark.eval"))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tau_table(results)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
