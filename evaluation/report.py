"""Evaluation report: the report files of an offline evaluation (metrics: serving/metrics.py).

`write_report(results, out_dir)` takes one result of `evaluation.evaluate.evaluate` or a list of them (one per
drafter / temperature) and writes
- report.json       every metric of every run (generations left out),
- report.md         one table row per (dataset, run),
- acceptance.png    per-position conditional acceptance, one panel per dataset, one line per run,
- generations.jsonl the generated tokens/text of every prompt (one line per prompt).

matplotlib is imported only when the plot is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["json_safe", "run_label", "write_report"]


# ---- report files -------------------------------------------------------------------------------------------


def run_label(result: dict) -> str:
    t = result["temperature"]
    return f"{result['drafter']} (γ={result['gamma']}, {'greedy' if t == 0 else f'T={t:g}'})"


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def json_safe(x):
    """NaN is not JSON: write null instead."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
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
    summary = [{k: v for k, v in r.items() if k not in ("generations", "rounds")} for r in runs]
    paths["report.json"].write_text(json.dumps(json_safe({"runs": summary}), indent=2) + "\n")
    paths["report.md"].write_text(_markdown(runs))
    _plot(runs, paths["acceptance.png"])
    with paths["generations.jsonl"].open("w") as f:
        for r in runs:
            for ds, gens in r.get("generations", {}).items():
                for i, g in enumerate(gens):
                    f.write(json.dumps({"run": run_label(r), "dataset": ds, "index": i, **g}) + "\n")
    return paths
