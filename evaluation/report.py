"""Evaluation report: the report files of an offline evaluation (metrics: serving/metrics.py).

`write_report(results, out_dir)` takes one result of `evaluation.evaluate.evaluate` or a list of them (one per
drafter / temperature) and writes
- report.json       every metric of every run (generations left out),
- report.md         one table row per (dataset, run),
- acceptance.png    per-position conditional acceptance, one panel per dataset, one line per run with a draft
                    (each point labelled with its number of rounds, with its 95% Wilson score interval),
- generations.jsonl the generated tokens/text of every prompt (one line per prompt);
and `tau_table` / `speedup_table` give the console tables of τ and of end-to-end speed-ups (printed by
launch/evaluate_draft.py).

matplotlib is imported only when the plot is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["acceptance_figure", "json_safe", "run_label", "speedup_table", "tau_table", "wilson_interval",
           "write_report"]


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


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (z = 1.96: 95%); (nan, nan) for n = 0.

    Unlike p ± z·sqrt(p(1−p)/n) it stays inside [0, 1] and does not collapse to a point at p = 0 or 1: one accepted
    round of one gives [0.21, 1], not [1, 1]."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return math.nan, math.nan
    p, z2 = successes / n, z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


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
            reached = m.get("reached") or [None] * len(m["cond_acceptance"])
            acc = " ".join(_fmt(a, 2) + ("" if n is None else f" ({n})") for a, n in zip(m["cond_acceptance"], reached))
            lines.append(f"| {ds} | {run_label(r)} | {_fmt(m['tau'])} ± {_fmt(m['tau_sem'])} | {acc} "
                         f"| {m['target_forwards']} | {_fmt(m['tokens_per_forward'], 2)} | {_fmt(m['wall_s'], 1)} "
                         f"| {_fmt(m['tokens_per_s'], 1)} | {_fmt(m['ece'])} | {_fmt(m['roc_auc'])} |")
    notes = ["", "τ = accepted draft tokens + 1 per verification round (mean ± standard error). Conditional "
             "acceptance at k = P(token k accepted | tokens 1..k−1 accepted), with the number of rounds that "
             "reached k in parentheses; '–' where no round reached k. "
             "target fwd counts prefills and verification rounds. ECE (10 bins) and ROC-AUC compare the "
             "drafter's conditional confidence c_k with acceptance at every reached position."]
    return "\n".join(lines + notes) + "\n"


def _points(m: dict) -> list[tuple[int, float, int | None]]:
    """(k, conditional acceptance, rounds that reached k) of every position some round reached; the count is None
    in results cached before it was recorded."""
    reached = m.get("reached") or [None] * len(m["cond_acceptance"])
    return [(k, a, n) for k, (a, n) in enumerate(zip(m["cond_acceptance"], reached), start=1)
            if a is not None and not math.isnan(a)]


def acceptance_figure(runs: list[dict]):
    """The figure of acceptance.png: per dataset a panel, per run with a draft a line of its conditional acceptance
    by position, each point labelled with its number of rounds and drawn with its 95% Wilson interval, so that a
    position two rounds reached does not pass for a measured 1.00. A run with no position (the target alone) has no
    line and no legend entry."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(ds for r in runs for ds in r["datasets"]))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        drawn = [(r, _points(r["datasets"][ds])) for r in runs if ds in r["datasets"]]
        drawn = [(r, pts) for r, pts in drawn if pts]
        for i, (r, pts) in enumerate(drawn):
            ks = [k for k, _, _ in pts]
            ps = [a for _, a, _ in pts]
            lo_hi = [wilson_interval(round(a * n), n) if n else (a, a) for _, a, n in pts]
            # no negative bar from rounding: Wilson's lower bound of 0 of 11 comes out as 3e-17, above a = 0
            yerr = [[max(0.0, a - lo) for a, (lo, _) in zip(ps, lo_hi)],
                    [max(0.0, hi - a) for a, (_, hi) in zip(ps, lo_hi)]]
            bars = ax.errorbar(ks, ps, yerr=yerr, marker="o", markersize=4, capsize=3, elinewidth=0.8,
                               label=f"{run_label(r)}  τ={r['datasets'][ds]['tau']:.2f}")
            color = bars.lines[0].get_color()
            for k, a, n in pts:
                if n is not None:  # stacked per run so that the runs' labels at one k do not overlap
                    ax.annotate(f"n={n}", (k, a), xytext=(5, -10 - 8 * i), textcoords="offset points", fontsize=6,
                                color=color)
        ax.set_title(ds)
        ax.set_xlabel("draft position k  (n: rounds reaching k; bars: 95% Wilson)", fontsize=8)
        ax.set_ylabel("P(accept k | 1..k−1 accepted)")
        gamma = max([len(r["datasets"][ds]["cond_acceptance"]) for r in runs if ds in r["datasets"]] + [1])
        ax.set_xticks(range(1, gamma + 1))
        ax.set_xlim(0.6, gamma + 0.6)  # room for the labels right of the last position
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no draft position reached", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = acceptance_figure(runs)
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


# ---- console tables ----------------------------------------------------------------------------------------


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
