"""An evaluation run over exported drafts: every export at every temperature on the same prompts, by real
speculative decoding against the target (evaluation/evaluate.py), each (draft, temperature) result cached in the
output directory so that an interrupted run resumes. The CLI is launch/evaluate_draft.py.

Writes report.json, report.md and acceptance.png (evaluation/report.py), and per (draft, temperature)
NAME-T{T}.json (the cached result) and NAME-T{T}.rounds.parquet (the recorded rounds, evaluation/rounds.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path


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
    from evaluation.progress import EvalProgress
    from evaluation.prompts import resolve_prompt_sets
    from evaluation.report import write_report
    from evaluation.rounds import write_rounds
    from pipeline.atomic import write_text_atomic
    from workers.frozen_target.model import load_target, resolve_target_path
    from workers.frozen_target.target_files import check_target_files

    check_exports(exports)
    bad = [t for t in temperatures if not t >= 0]
    if bad:
        raise ValueError(f"temperatures must be >= 0 (0 = greedy), got {bad}")
    prompts = resolve_prompt_sets(datasets, num_prompts)  # before the target loads: bad input fails fast
    t_start = time.monotonic()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target_path = resolve_target_path(target_name)
    check_target_files(target_path)  # a damaged file is one line naming it, not a traceback in transformers
    target, tok = load_target(target_path, dtype=dtype)
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
            progress = EvalProgress(f"eval T={temperature:g}", len(todo) * sum(map(len, prompts.values())), log)
            try:
                fresh = dict(zip(todo, evaluate_many(target, tok, [drafters[name] for name in todo], prompts,
                                                     temperature, max_new_tokens, seed=0, deadline_s=deadline,
                                                     progress=progress)))
            finally:
                progress.close()
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
    """Every export's files, before the target loads: a missing or damaged one is a ValueError naming it."""
    from pipeline.export import check_export

    for name, export in exports.items():
        if not (Path(export) / "config.json").is_file() or not (Path(export) / "model.safetensors").is_file():
            raise ValueError(f"draft {name!r}: {export} is not an exported draft (needs config.json and "
                             "model.safetensors)")
        check_export(export)


def _cache_valid(path: Path, drafter) -> bool:
    """A cached result counts when it and its rounds exist and it was run with the drafter's calibration."""
    if not (path.is_file() and _rounds_path(path).is_file()):
        return False
    return json.loads(path.read_text()).get("sts_temperatures") == drafter.sts_temperatures


def _rounds_path(cached_result: Path) -> Path:
    return cached_result.with_name(cached_result.stem + ".rounds.parquet")
