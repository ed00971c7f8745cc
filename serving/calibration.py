"""Sequential temperature scaling (STS) of the draft's confidence head (DESIGN.md §1 "Calibration (STS)").

Legend (shape suffixes):  N  recorded verification rounds   K  draft positions γ   G  grid temperatures
`...K` means any leading shape with positions last.

The confidence head predicts c_k = P(token k accepted | tokens 1..k−1 accepted); the scheduler uses the survival
a_k = Π_{i≤k} c_i, the probability that the prefix 1..k survives. STS calibrates the survival, not each c_k on
its own: for k = 1..K in order, T_k is the grid value minimising the ECE of Π_{i≤k} σ(logit_i / T_i) against the
observed outcome "tokens 1..k were all accepted" (num_accepted ≥ k), with T_1..T_{k−1} kept fixed.

The data: a drafter computes all K confidences whenever it drafts, so every recorded round has a logit at every
position and the cumulative product is defined everywhere; no reach mask is needed (rounds that failed before k
are negatives for the survival at k, which is exactly what the scheduler has to predict).

A positive temperature is a monotone map of the logit, so STS preserves the order of the confidences at each
position (ROC-AUC of c_k unchanged); the cumulative product's order across rounds can change for k > 1 because
the positions get different temperatures, which is why the report gives the AUC of the survival before/after.

One temperature for every position (`fit_single_temperature`) is the calibration an engine that applies a plain
sigmoid to one linear layer shared by all positions can run: vLLM's DSpark confidence head computes
σ(w·x + b), and σ((w·x + b) / T) = σ((w/T)·x + b/T) folds T into the layer exactly (serving/engine_export.py does).
Per-position temperatures cannot be folded into a layer all positions share.

The calibrated temperatures live in `calibration.json` beside an exported draft (save_calibration /
load_calibration): the per-position T_1..T_K and, since format dspark-sts/2, the single T. Metrics reuse
serving.metrics (expected_calibration_error, roc_auc).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from serving._io import atomic_write_json, read_json
from serving.metrics import expected_calibration_error, roc_auc

__all__ = ["DEFAULT_GRID", "Calibration", "apply_sts", "calibration_report", "fit_single_temperature", "fit_sts",
           "load_calibration", "plot_reliability", "save_calibration", "survival", "sigmoid"]

# 0.05 .. 20 in ratio steps of ~1.5 %, with 1.0 (no change) on the grid so STS can never do worse than T = 1 on
# the fitting data
DEFAULT_GRID = np.unique(np.r_[np.geomspace(0.05, 20.0, 401), 1.0])
CALIBRATION_FORMAT = "dspark-sts/2"  # /2 adds "single_temperature" (null: not fitted)
OLDER_FORMATS = ("dspark-sts/1",)  # still read: no single temperature


class Calibration(NamedTuple):
    """calibration.json: per-position STS temperatures, the single temperature (None in dspark-sts/1 files), meta."""

    temperatures: np.ndarray  # T_1..T_K
    single_temperature: float | None  # one T for every position (foldable into the engines' confidence head)
    meta: dict


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) without overflow warnings for large |x| (tanh form)."""
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))


def _temperatures(temperatures_K: Sequence[float] | np.ndarray, K: int | None = None) -> np.ndarray:
    t_K = np.asarray(temperatures_K, dtype=np.float64)
    if t_K.ndim != 1 or t_K.size == 0:
        raise ValueError(f"temperatures must be a non-empty 1-D list, got shape {t_K.shape}")
    if not np.all(np.isfinite(t_K) & (t_K > 0)):
        raise ValueError(f"temperatures must be positive and finite, got {t_K.tolist()}")
    if K is not None and t_K.size != K:
        raise ValueError(f"got {t_K.size} temperatures for {K} draft positions")
    return t_K


def apply_sts(conf_logit_K: np.ndarray, temperatures_K: Sequence[float] | np.ndarray) -> np.ndarray:
    """Calibrated conditional confidences σ(logit_k / T_k), any leading shape, positions on the last axis."""
    logit_K = np.asarray(conf_logit_K, dtype=np.float64)
    return sigmoid(logit_K / _temperatures(temperatures_K, logit_K.shape[-1]))


def survival(conf_K: np.ndarray) -> np.ndarray:
    """Cumulative survival a_k = Π_{i≤k} c_i along the last axis (non-increasing in k for c in [0, 1])."""
    return np.cumprod(np.asarray(conf_K, dtype=np.float64), axis=-1)


def _check_records(conf_logit_NK: np.ndarray, num_accepted_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    logit_NK = np.asarray(conf_logit_NK, dtype=np.float64)
    n_N = np.asarray(num_accepted_N)
    if logit_NK.ndim != 2 or logit_NK.shape[0] == 0 or logit_NK.shape[1] == 0:
        raise ValueError(f"conf_logit must be [N rounds, K positions] with N, K >= 1, got shape {logit_NK.shape}")
    if n_N.shape != (logit_NK.shape[0],):
        raise ValueError(f"num_accepted must have one entry per round ({logit_NK.shape[0]}), got shape {n_N.shape}")
    if not np.all(np.isfinite(logit_NK)):
        raise ValueError("conf_logit contains NaN or inf")
    if n_N.size and (n_N.min() < 0 or n_N.max() > logit_NK.shape[1] or not np.all(n_N == np.round(n_N))):
        raise ValueError(f"num_accepted must be integers in 0..K={logit_NK.shape[1]}")
    return logit_NK, n_N.astype(np.int64)


def _survived_NK(n_N: np.ndarray, K: int) -> np.ndarray:
    # column k-1 is the outcome for position k: tokens 1..k all accepted  <=>  num_accepted >= k
    return (n_N[:, None] >= np.arange(1, K + 1)[None, :]).astype(np.float64)


def fit_sts(conf_logit_NK: np.ndarray, num_accepted_N: np.ndarray,
            grid: Sequence[float] | np.ndarray = DEFAULT_GRID, num_bins: int = 10) -> np.ndarray:
    """Fit T_1..T_K left to right, each by a 1-D grid search minimising the ECE of the cumulative survival.

    conf_logit_NK: pre-sigmoid confidence logits of N recorded rounds; num_accepted_N: accepted draft tokens of
    each round if all K were verified. Returns temperatures_K. Ties on the grid go to the value closest to 1.
    """
    logit_NK, n_N = _check_records(conf_logit_NK, num_accepted_N)
    grid_G = _temperatures(grid)
    # prefer the least change on ties: scan the grid ordered by |log T|
    grid_G = grid_G[np.argsort(np.abs(np.log(grid_G)), kind="stable")]
    N, K = logit_NK.shape
    survived_NK = _survived_NK(n_N, K)
    t_K = np.ones(K)
    prefix_N = np.ones(N)  # Π_{i<k} σ(logit_i / T_i) with the temperatures already fixed
    for k in range(K):
        ece_G = [expected_calibration_error(prefix_N * sigmoid(logit_NK[:, k] / t), survived_NK[:, k], num_bins)
                 for t in grid_G]
        t_K[k] = grid_G[int(np.argmin(ece_G))]
        prefix_N = prefix_N * sigmoid(logit_NK[:, k] / t_K[k])
    return t_K


def fit_single_temperature(conf_logit_NK: np.ndarray, num_accepted_N: np.ndarray,
                           grid: Sequence[float] | np.ndarray = DEFAULT_GRID, num_bins: int = 10) -> float:
    """One temperature T for every position: the grid value minimising the mean over k = 1..K of the ECE of the
    survival Π_{i≤k} σ(logit_i / T), the quantity STS calibrates per position. Ties go to the value closest to 1."""
    logit_NK, n_N = _check_records(conf_logit_NK, num_accepted_N)
    grid_G = _temperatures(grid)
    grid_G = grid_G[np.argsort(np.abs(np.log(grid_G)), kind="stable")]
    survived_NK = _survived_NK(n_N, logit_NK.shape[1])

    def mean_ece(t: float) -> float:
        a_NK = survival(sigmoid(logit_NK / t))
        return float(np.mean([expected_calibration_error(a_NK[:, k], survived_NK[:, k], num_bins)
                              for k in range(a_NK.shape[1])]))

    return float(grid_G[int(np.argmin([mean_ece(t) for t in grid_G]))])


def calibration_report(conf_logit_NK: np.ndarray, num_accepted_N: np.ndarray,
                       temperatures_K: Sequence[float] | np.ndarray, num_bins: int = 10,
                       single_temperature: float | None = None) -> dict:
    """Per-position ECE and ROC-AUC of the cumulative survival before (T = 1) and after STS, and with
    `single_temperature` under that one T as well ("single": what an engine with the T folded into its confidence
    head computes).

    Lists are indexed by position k = 1..K (list index k−1); an AUC is NaN where one class is absent.
    """
    logit_NK, n_N = _check_records(conf_logit_NK, num_accepted_N)
    t_K = _temperatures(temperatures_K, logit_NK.shape[1])
    survived_NK = _survived_NK(n_N, logit_NK.shape[1])
    report: dict = {"num_rounds": int(logit_NK.shape[0]), "num_bins": num_bins, "temperatures": t_K.tolist()}
    curves = [("before", survival(sigmoid(logit_NK))), ("after", survival(apply_sts(logit_NK, t_K)))]
    if single_temperature is not None:
        report["single_temperature"] = float(_temperatures([single_temperature])[0])
        curves.append(("single", survival(sigmoid(logit_NK / report["single_temperature"]))))
    for tag, a_NK in curves:
        report[f"ece_{tag}"] = [expected_calibration_error(a_NK[:, k], survived_NK[:, k], num_bins)
                                for k in range(a_NK.shape[1])]
        report[f"roc_auc_{tag}"] = [roc_auc(a_NK[:, k], survived_NK[:, k]) for k in range(a_NK.shape[1])]
    report["observed_survival"] = survived_NK.mean(0).tolist()
    return report


def save_calibration(path: str | Path, temperatures: Sequence[float] | np.ndarray, meta: Mapping | None = None,
                     single_temperature: float | None = None) -> Path:
    """Write calibration.json atomically: {"format", "temperatures" (T_1..T_K), "single_temperature" (one T for
    every position, or null), "meta" (free-form, JSON-able)}."""
    t_K = _temperatures(temperatures)
    single = None if single_temperature is None else float(_temperatures([single_temperature])[0])
    return atomic_write_json(path, {"format": CALIBRATION_FORMAT, "temperatures": t_K.tolist(),
                                    "single_temperature": single, "meta": dict(meta or {})})


def _positive(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def load_calibration(path: str | Path) -> Calibration:
    """Read calibration.json (dspark-sts/2, or /1 without a single temperature). Any malformed file is a one-line
    ValueError naming it."""
    obj = read_json(path, "calibration file")
    bad = f"malformed calibration file {path}:"
    if not isinstance(obj, dict):
        raise ValueError(f"{bad} expected a JSON object")
    formats = (CALIBRATION_FORMAT, *OLDER_FORMATS)
    if obj.get("format") not in formats:
        raise ValueError(f"{bad} format must be one of {list(formats)}, got {obj.get('format')!r}")
    keys = {"format", "temperatures", "meta"} | ({"single_temperature"} if obj["format"] == CALIBRATION_FORMAT
                                                 else set())
    if set(obj) != keys:
        raise ValueError(f"{bad} keys must be {sorted(keys)}, got {sorted(obj)}")
    temps = obj["temperatures"]
    if not isinstance(temps, list) or not temps or not all(_positive(t) for t in temps):
        raise ValueError(f"{bad} temperatures must be a non-empty list of positive numbers, got {temps!r}")
    single = obj.get("single_temperature")
    if single is not None and not _positive(single):
        raise ValueError(f"{bad} single_temperature must be a positive number or null, got {single!r}")
    if not isinstance(obj["meta"], dict):
        raise ValueError(f"{bad} meta must be an object")
    return Calibration(np.asarray(temps, dtype=np.float64), None if single is None else float(single), obj["meta"])


def _reliability_bins(conf_N: np.ndarray, outcome_N: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    bins_N = np.clip((conf_N * num_bins).astype(np.int64), 0, num_bins - 1)
    count_B = np.bincount(bins_N, minlength=num_bins)
    keep_B = count_B > 0
    mean_conf = np.bincount(bins_N, weights=conf_N, minlength=num_bins)[keep_B] / count_B[keep_B]
    mean_out = np.bincount(bins_N, weights=outcome_N, minlength=num_bins)[keep_B] / count_B[keep_B]
    return mean_conf, mean_out


def plot_reliability(conf_logit_NK: np.ndarray, num_accepted_N: np.ndarray,
                     temperatures_K: Sequence[float] | np.ndarray, path: str | Path, num_bins: int = 10) -> Path:
    """Reliability diagram of the survival, one panel per position, before and after STS (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    logit_NK, n_N = _check_records(conf_logit_NK, num_accepted_N)
    rep = calibration_report(logit_NK, n_N, temperatures_K, num_bins)
    survived_NK = _survived_NK(n_N, logit_NK.shape[1])
    curves = {"before (T=1)": survival(sigmoid(logit_NK)), "after STS": survival(apply_sts(logit_NK, temperatures_K))}
    K = logit_NK.shape[1]
    fig, axes = plt.subplots(1, K, figsize=(3.2 * K, 3.3), squeeze=False)
    for k, ax in enumerate(axes[0]):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for (label, a_NK), tag in zip(curves.items(), ("before", "after")):
            x, y = _reliability_bins(a_NK[:, k], survived_NK[:, k], num_bins)
            ax.plot(x, y, marker="o", ms=3, label=f"{label}  ECE={rep[f'ece_{tag}'][k]:.3f}")
        ax.set_title(f"k={k + 1}  T={rep['temperatures'][k]:.2f}")
        ax.set_xlabel("predicted survival Π c_i")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("observed: tokens 1..k accepted")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
