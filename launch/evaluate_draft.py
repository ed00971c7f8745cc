"""Evaluate trained drafts by real speculative decoding against their target: τ, per-position acceptance, ECE.

    python launch/evaluate_draft.py --draft runs/tiny/export [--draft other=runs/x/export ...] \
        --target smollm2 --datasets humaneval gsm8k mtbench --num-prompts 10 --max-new-tokens 64 \
        --temperatures 1.0 0.0 --out runs/tiny/eval
    python launch/evaluate_draft.py --draft runs/tiny/export --prompts held_out.jsonl --out runs/tiny/eval-mine

--datasets names built-in sets (evaluation/prompts.py); --prompts adds prompt files (.jsonl/.parquet of chats or
texts), each a dataset named by its file stem (given alone, only the files are evaluated). An export holding
calibration.json (launch/calibrate_draft.py) is evaluated with calibrated confidences.

Writes report.json, report.md and acceptance.png under --out (evaluation/report.py) and prints the τ table, and
per (draft, temperature) NAME-T{T}.rounds.parquet, the recorded rounds (evaluation/rounds.py: per-round raw
confidence logits, accepted count n, draft time), which serving/simulator.py replays.
Each (draft, temperature) result is cached in --out, so an interrupted evaluation resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def evaluate_exports(exports: dict[str, Path], target_name: str, datasets: list[str], num_prompts: int,
                     max_new_tokens: int, temperatures: list[float], out_dir: Path, device: str = "auto",
                     log=None, time_limit_s: float | None = None, autoregressive: bool = False) -> list[dict]:
    """Evaluate every export at every temperature on the same prompts; results cached per (draft, temperature).

    autoregressive adds the target alone (evaluation.drafters.TargetOnly, named "autoregressive"), decoded on the
    same prompts in turn with the drafts, the baseline of end-to-end speed-ups (`speedup_table`).

    time_limit_s bounds the whole evaluation: each temperature gets an equal share of what is left, and prompts
    stop being started when it runs out, for all drafts alike (evaluation/evaluate.evaluate_many), so the drafts stay
    comparable; a cut result says how many prompts ran and is not cached.
    """
    import torch

    from evaluation.drafters import AUTOREGRESSIVE, TargetOnly, load_drafter
    from evaluation.evaluate import evaluate_many
    from evaluation.prompts import resolve_prompt_sets
    from evaluation.report import write_report
    from evaluation.rounds import write_rounds
    from pipeline.atomic import write_text_atomic
    from workers.target.model import load_target, resolve_target_path

    check_exports(exports)
    bad = [t for t in temperatures if not t >= 0]
    if bad:
        raise ValueError(f"temperatures must be >= 0 (0 = greedy), got {bad}")
    prompts = resolve_prompt_sets(datasets, num_prompts)  # before the target loads: bad input fails fast
    t_start = time.monotonic()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target, tok = load_target(resolve_target_path(target_name), dtype=dtype)
    target.to(device)
    drafters = {name: load_drafter(export, target, name) for name, export in exports.items()}
    if autoregressive:
        if AUTOREGRESSIVE in drafters:
            raise ValueError(f"a draft may not be named {AUTOREGRESSIVE!r}: the baseline has that name")
        drafters[AUTOREGRESSIVE] = TargetOnly(target.get_output_embeddings().weight.shape[0])
    results = []
    for n, temperature in enumerate(temperatures):
        cached = {name: out_dir / f"{name}-T{temperature}.json" for name in drafters}
        todo = [name for name, path in cached.items() if not _cache_valid(path, drafters[name])]
        deadline = None
        if time_limit_s is not None:
            left = time_limit_s - (time.monotonic() - t_start)
            deadline = time.monotonic() + left / (len(temperatures) - n)
        if autoregressive and todo and AUTOREGRESSIVE not in todo:
            todo.append(AUTOREGRESSIVE)  # a speed-up divides by the baseline decoded in the same turn
        fresh = {}
        if todo:
            t0 = time.time()
            fresh = dict(zip(todo, evaluate_many(target, tok, [drafters[name] for name in todo], prompts,
                                                 temperature, max_new_tokens, seed=0, deadline_s=deadline)))
            decoded_together = f"{time.time():.6f}"  # which results were decoded in turn (speedup_table pairs them)
            for res in fresh.values():
                res["decode_batch"] = decoded_together
        for name, path in cached.items():
            res = fresh[name] if name in fresh else json.loads(path.read_text())
            ran = {ds: m["num_prompts"] for ds, m in res["datasets"].items()}
            if name in fresh:
                rounds = res.pop("rounds")
                if all(ran[ds] == len(prompts[ds]) for ds in prompts):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_rounds({**res, "rounds": rounds}, _rounds_path(path))
                    write_text_atomic(path, json.dumps(res))
                elif log is not None:
                    log.warning("eval %s T=%.1f: time limit reached after %s prompts per dataset (not cached)",
                                name, temperature, ran)
                if log is not None:
                    log.info("eval %s T=%.1f: %.0f s for all drafts, tau %s", name, temperature, time.time() - t0,
                             {ds: round(m["tau"], 3) for ds, m in res["datasets"].items()})
            results.append(res)
    write_report(results, out_dir)
    return results


def check_exports(exports: dict[str, Path]) -> None:
    for name, export in exports.items():
        if not (Path(export) / "config.json").is_file() or not (Path(export) / "model.safetensors").is_file():
            raise ValueError(f"draft {name!r}: {export} is not an exported draft (needs config.json and "
                             "model.safetensors)")


def _cache_valid(path: Path, drafter) -> bool:
    """A cached result counts when it and its rounds exist and it was run with the drafter's calibration."""
    if not (path.is_file() and _rounds_path(path).is_file()):
        return False
    return json.loads(path.read_text()).get("sts_temperatures") == drafter.sts_temperatures


def _rounds_path(cached_result: Path) -> Path:
    return cached_result.with_name(cached_result.stem + ".rounds.parquet")


def tau_table(results: list[dict]) -> tuple[str, dict[tuple[str, float], float]]:
    """A text table of τ per dataset and the macro average, and the macro averages by (drafter, temperature)."""
    taus = {(r["drafter"], r["temperature"]): {ds: m["tau"] for ds, m in r["datasets"].items()} for r in results}
    datasets = sorted(next(iter(taus.values())))
    lines = [f"{'drafter':14}{'T':>5}" + "".join(f"{ds:>11}" for ds in datasets) + f"{'macro':>9}"]
    macro = {}
    for (name, temperature), row in sorted(taus.items()):
        macro[(name, temperature)] = sum(row.values()) / len(row)
        lines.append(f"{name:14}{temperature:>5.1f}" + "".join(f"{row[ds]:>11.3f}" for ds in datasets)
                     + f"{macro[(name, temperature)]:>9.3f}")
    return "\n".join(lines), macro


def speedup_table(results: list[dict]) -> tuple[str, dict[tuple[str, float], float]]:
    """End-to-end decoding speed-up of each draft: its tokens/s over the autoregressive baseline's on the same
    dataset and temperature (wall time of whole decodes: target forwards, the draft's own time and the session's
    bookkeeping), the macro average over datasets, and each draft's median drafting time per round.

    Only results decoded in turn with the baseline (the same `decode_batch`) and on as many prompts are paired;
    any other row says why it has no speed-up. The baseline runs the same verify path as a draft (one target
    forward and one draw from the full vocabulary per token, plus the session's bookkeeping), which a bare
    `generate` loop would not: the ratios include that per-token overhead on the baseline's side.
    -> (text table, {(drafter, temperature): macro speed-up}); empty without an autoregressive result."""
    from evaluation.drafters import AUTOREGRESSIVE

    base = {(r["temperature"], r.get("decode_batch")): r["datasets"] for r in results
            if r["drafter"] == AUTOREGRESSIVE}
    rows = [r for r in results if r["drafter"] != AUTOREGRESSIVE and any(t == r["temperature"] for t, _ in base)]
    if not rows:
        return "", {}
    datasets = sorted(rows[0]["datasets"])
    lines = [f"{'drafter':14}{'T':>5}" + "".join(f"{ds:>11}" for ds in datasets) + f"{'macro':>9}"
             + f"{'draft ms/round':>16}"]
    macro = {}
    for r in sorted(rows, key=lambda r: (r["drafter"], r["temperature"])):
        ar = base.get((r["temperature"], r.get("decode_batch")))
        why = ("not decoded in turn with the baseline (cached from another run)" if ar is None else
               "ran on other prompts than the baseline" if any(
                   r["datasets"][ds]["num_prompts"] != ar[ds]["num_prompts"] or not r["datasets"][ds]["num_prompts"]
                   for ds in datasets) else "")
        if why:
            lines.append(f"{r['drafter']:14}{r['temperature']:>5.1f}  n/a: {why}")
            continue
        row = {ds: r["datasets"][ds]["tokens_per_s"] / ar[ds]["tokens_per_s"] for ds in datasets}
        key = (r["drafter"], r["temperature"])
        macro[key] = sum(row.values()) / len(row)
        draft_ms = [1e3 * r["datasets"][ds].get("draft_s_median", math.nan) for ds in datasets]
        lines.append(f"{r['drafter']:14}{r['temperature']:>5.1f}" + "".join(f"{row[ds]:>10.2f}x" for ds in datasets)
                     + f"{macro[key]:>8.2f}x" + f"{sum(draft_ms) / len(draft_ms):>16.1f}")
    return "\n".join(lines), macro


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    exports = {}
    for item in args.draft:
        name, _, path = item.rpartition("=")
        path = Path(path)
        exports[name or path.parent.name] = path
    try:
        datasets = (args.datasets or ([] if args.prompts else ["humaneval", "gsm8k", "mtbench"])) + args.prompts
        results = evaluate_exports(exports, args.target, datasets, args.num_prompts, args.max_new_tokens,
                                   args.temperatures, Path(args.out), args.device, get_logger("dspark.eval"),
                                   args.time_limit, args.autoregressive)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tau_table(results)[0])
    if args.autoregressive:
        print("\nend-to-end speed-up over the target alone (tokens/s ratio on the same prompts)")
        print(speedup_table(results)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
