"""STS calibration of an exported draft's confidence head on real decoding rounds (CLI: launch/calibrate_draft.py).

`calibrate` runs these steps:
1. real speculative decoding (evaluation/) of the prompts at `temperature`, recording every round's raw confidence
   logits and accepted count n -> <out>/rounds.parquet (evaluation/rounds.py);
2. the prompts of each set are split by a seeded shuffle: `fit_fraction` of them to fit on, the rest held out
   (split by prompt, not by round, because rounds of one prompt are correlated);
3. serving.calibration.fit_sts on the fit rounds -> T_1..T_γ, and fit_single_temperature -> one T for every
   position (what the engine exports fold into the confidence head: serving/engine_export.py), both written to
   <draft>/calibration.json, whose per-position temperatures evaluation.drafters.load_drafter applies from then on
   (every consumer of the export);
4. per-position ECE and ROC-AUC of the cumulative survival Π c_i before (T = 1), after STS and under the single
   temperature, measured on the HELD-OUT rounds only: the returned report, written to
   <out>/calibration_report.json, and the reliability diagram to <out>/reliability.png. `report_table` prints it.
Bad input (missing export, unreadable or empty prompt file, bad temperature, a draft without a confidence head)
is a one-line ValueError or FileNotFoundError.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path

import numpy as np


def split_prompts(num: int, fit_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices 0..num-1 -> (fit, held-out), a seeded shuffle; each side gets at least one prompt."""
    if num < 2:
        raise ValueError(f"need at least 2 prompts per set to fit on some and report on others, got {num}")
    order = np.random.default_rng(seed).permutation(num)
    n_fit = min(num - 1, max(1, round(fit_fraction * num)))
    return np.sort(order[:n_fit]), np.sort(order[n_fit:])


def pool_rounds(arrays: dict[str, dict], pick: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    logits, ns = [], []
    for ds, a in arrays.items():
        keep = np.isin(a["prompt_N"], pick[ds])
        logits.append(a["conf_logit_NK"][keep])
        ns.append(a["num_accepted_N"][keep])
    return np.concatenate(logits), np.concatenate(ns)


def report_table(rep: dict) -> str:
    """The before/after table of serving.calibration.calibration_report, one row per draft position."""
    def f(x: float) -> str:
        return "     –" if x is None or math.isnan(x) else f"{x:6.3f}"

    single = "ece_single" in rep
    lines = [f"{'k':>2} {'T_k':>6} {'ECE before':>10} {'ECE after':>10}" + (f" {'ECE one-T':>10}" if single else "")
             + f" {'AUC before':>10} {'AUC after':>10} {'survival':>9}"]
    for k in range(len(rep["temperatures"])):
        lines.append(f"{k + 1:>2} {rep['temperatures'][k]:6.3f} {f(rep['ece_before'][k]):>10} "
                     f"{f(rep['ece_after'][k]):>10}" + (f" {f(rep['ece_single'][k]):>10}" if single else "")
                     + f" {f(rep['roc_auc_before'][k]):>10} {f(rep['roc_auc_after'][k]):>10} "
                     f"{rep['observed_survival'][k]:9.3f}")
    if single:
        lines.append(f"one temperature for every position (folded into the engines' confidence head): "
                     f"T = {rep['single_temperature']:.3f}")
    return "\n".join(lines)


def calibrate(export: Path, target_name: str, prompt_names: list[str], num_prompts: int | None,
              max_new_tokens: int, temperature: float, out_dir: Path, fit_fraction: float = 0.5, seed: int = 0,
              device: str = "auto", log=None) -> dict:
    """Steps 1-4 of the module docstring; returns the report (also written to out_dir/calibration_report.json)."""
    import torch

    from evaluation.drafters import CALIBRATION_FILE, load_drafter
    from evaluation.evaluate import evaluate
    from evaluation.prompts import resolve_prompt_sets
    from evaluation.report import json_safe
    from evaluation.rounds import load_round_arrays, write_rounds
    from evaluation.run import check_exports
    from serving.calibration import (
        calibration_report,
        fit_single_temperature,
        fit_sts,
        plot_reliability,
        save_calibration,
    )
    from workers.frozen_target.model import load_target, resolve_target_path

    check_exports({"draft": export})
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"the decoding temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0 < fit_fraction < 1:
        raise ValueError(f"the fit fraction (the share of each set's prompts fitted on) must be in (0, 1), "
                         f"got {fit_fraction}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = resolve_prompt_sets(prompt_names, num_prompts)
    splits = {ds: split_prompts(len(items), fit_fraction, seed) for ds, items in prompts.items()}
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # as evaluation/run.py
    target, tok = load_target(resolve_target_path(target_name), dtype=dtype)
    target.to(device)
    # raw confidences: what is fitted is the logits, and "before" must not depend on an earlier calibration
    drafter = load_drafter(export, target, name=export.parent.name, calibrated=False)
    if getattr(drafter.model, "conf_proj", None) is None:
        raise ValueError(f"{export}: the draft has no confidence head (draft.confidence=false); nothing to calibrate")
    if log is not None:
        log.info("calibrate: decoding %s prompts at T=%g", {ds: len(v) for ds, v in prompts.items()}, temperature)
    result = evaluate(target, tok, drafter, prompts, temperature, max_new_tokens, seed=seed)
    rounds_path = write_rounds(result, out_dir / "rounds.parquet")
    arrays, _ = load_round_arrays(rounds_path)
    fit_logit, fit_n = pool_rounds(arrays, {ds: s[0] for ds, s in splits.items()})
    held_logit, held_n = pool_rounds(arrays, {ds: s[1] for ds, s in splits.items()})
    temps = fit_sts(fit_logit, fit_n)
    single = fit_single_temperature(fit_logit, fit_n)
    rep = calibration_report(held_logit, held_n, temps, single_temperature=single)
    rep.update(split="held-out", fit_rounds=int(fit_logit.shape[0]),
               fit_report=calibration_report(fit_logit, fit_n, temps, single_temperature=single),
               prompts={ds: {"fit": s[0].tolist(), "held_out": s[1].tolist()} for ds, s in splits.items()},
        tau={ds: m["tau"] for ds, m in result["datasets"].items()})
    meta = {"target": target_name, "decoding_temperature": temperature, "max_new_tokens": max_new_tokens,
            "prompt_sets": prompt_names, "fit_rounds": rep["fit_rounds"], "held_out_rounds": rep["num_rounds"],
            "fit_fraction": fit_fraction, "seed": seed, "date": dt.date.today().isoformat(),
            "method": "serving.calibration.fit_sts and fit_single_temperature (grid, ECE of the cumulative "
                      "survival, 10 bins)",
            "held_out_ece_before": rep["ece_before"], "held_out_ece_after": rep["ece_after"],
            "held_out_ece_single": rep["ece_single"]}
    save_calibration(export / CALIBRATION_FILE, temps, json_safe(meta), single)
    plot_reliability(held_logit, held_n, temps, out_dir / "reliability.png")
    (out_dir / "calibration_report.json").write_text(json.dumps(json_safe(rep), indent=2) + "\n")
    return rep
