"""Evaluation report: calibration metrics (ECE, ROC-AUC) and the report files of an offline evaluation.

`write_report(results, out_dir)` takes one result of `evaluation.evaluate.evaluate` or a list of them (one per
drafter / temperature) and writes
- report.json       every metric of every run (generations left out),
- report.md         one table row per (dataset, run),
- acceptance.png    per-position conditional acceptance, one panel per dataset, one line per run,
- generations.jsonl the generated tokens/text of every prompt (one line per prompt).

The metric helpers are numpy-only; matplotlib is imported only when the plot is drawn.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["expected_calibration_error", "roc_auc", "run_label", "write_report"]


def expected_calibration_error(confidence: Sequence[float] | np.ndarray, outcome: Sequence[float] | np.ndarray,
                               num_bins: int = 10) -> float:
    """ECE with `num_bins` equal-width bins on [0, 1]: Σ_b (n_b / n) |mean confidence_b − mean outcome_b|.

    `outcome` is 1 where the event happened (the token was accepted), else 0. NaN for empty input.
    """
    c = np.asarray(confidence, dtype=np.float64).ravel()
    y = np.asarray(outcome, dtype=np.float64).ravel()
    if c.shape != y.shape:
        raise ValueError(f"confidence ({c.shape[0]}) and outcome ({y.shape[0]}) must have the same length")
    if c.size == 0:
        return math.nan
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    # bin b holds [b/n, (b+1)/n); confidence 1.0 goes into the last bin
    bins = np.clip((c * num_bins).astype(np.int64), 0, num_bins - 1)
    conf_sum = np.bincount(bins, weights=c, minlength=num_bins)
    out_sum = np.bincount(bins, weights=y, minlength=num_bins)
    return float(np.abs(conf_sum - out_sum).sum() / c.size)  # Σ_b n_b/n |conf_b/n_b − out_b/n_b|


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x, tied values sharing the mean of their ranks."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # start index of each run of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], xs.size]
    mean_rank = (starts + ends + 1) / 2.0  # mean of the 1-based ranks starts+1 .. ends
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return ranks


def roc_auc(score: Sequence[float] | np.ndarray, label: Sequence[float] | np.ndarray) -> float:
    """Area under the ROC curve by the rank (Mann-Whitney U) formula, ties counted one half.

    AUC = (Σ ranks of positives − n⁺(n⁺+1)/2) / (n⁺ n⁻): the probability that a random positive scores above a
    random negative. NaN when either class is absent (the AUC is undefined then).
    """
    s = np.asarray(score, dtype=np.float64).ravel()
    y = np.asarray(label).ravel().astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"score ({s.shape[0]}) and label ({y.shape[0]}) must have the same length")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum = _average_ranks(s)[y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ---- report files -------------------------------------------------------------------------------------------


def run_label(result: dict) -> str:
    t = result["temperature"]
    return f"{result['drafter']} (γ={result['gamma']}, {'greedy' if t == 0 else f'T={t:g}'})"


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _json_safe(x):
    """NaN is not JSON: write null instead."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _markdown(runs: list[dict]) -> str:
    lines = ["| dataset | drafter | τ | conditional acceptance k=1..γ | target fwd | tok/fwd | wall s | tok/s "
             "| ECE | ROC-AUC |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    datasets = list(dict.fromkeys(ds for r in runs for ds in r["datasets"]))
    for ds in datasets:
        for r in runs:
            m = r["datasets"].get(ds)
            if m is None:
                continue
            acc = " ".join(_fmt(a, 2) for a in m["cond_acceptance"])
            lines.append(f"| {ds} | {run_label(r)} | {_fmt(m['tau'])} ± {_fmt(m['tau_sem'])} | {acc} "
                         f"| {m['target_forwards']} | {_fmt(m['tokens_per_forward'], 2)} | {_fmt(m['wall_s'], 1)} "
                         f"| {_fmt(m['tokens_per_s'], 1)} | {_fmt(m['ece'])} | {_fmt(m['roc_auc'])} |")
    notes = ["", "τ = accepted draft tokens + 1 per verification round (mean ± standard error). Conditional "
             "acceptance at k = P(token k accepted | tokens 1..k−1 accepted); '–' where no round reached k. "
             "target fwd counts prefills and verification rounds. ECE (10 bins) and ROC-AUC compare the "
             "drafter's conditional confidence c_k with acceptance at every reached position."]
    return "\n".join(lines + notes) + "\n"


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(ds for r in runs for ds in r["datasets"]))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for r in runs:
            m = r["datasets"].get(ds)
            if m is None:
                continue
            acc = [math.nan if a is None else a for a in m["cond_acceptance"]]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{run_label(r)}  τ={m['tau']:.2f}")
        ax.set_title(ds)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k−1 accepted)")
        ax.set_xticks(range(1, max(len(r["datasets"][ds]["cond_acceptance"]) for r in runs
                                   if ds in r["datasets"]) + 1))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict | list[dict], out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, report.md, acceptance.png and generations.jsonl into out_dir; returns their paths."""
    runs = [results] if isinstance(results, dict) else list(results)
    if not runs:
        raise ValueError("write_report needs at least one evaluation result")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("report.json", "report.md", "acceptance.png", "generations.jsonl")}
    summary = [{k: v for k, v in r.items() if k != "generations"} for r in runs]
    paths["report.json"].write_text(json.dumps(_json_safe({"runs": summary}), indent=2) + "\n")
    paths["report.md"].write_text(_markdown(runs))
    _plot(runs, paths["acceptance.png"])
    with paths["generations.jsonl"].open("w") as f:
        for r in runs:
            for ds, gens in r.get("generations", {}).items():
                for i, g in enumerate(gens):
                    f.write(json.dumps({"run": run_label(r), "dataset": ds, "index": i, **g}) + "\n")
    return paths
