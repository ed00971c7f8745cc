"""Recorded verification rounds of an evaluation: rounds.parquet, and its replay streams for serving/simulator.py.

One file per (drafter, decoding temperature), one row per round, every dataset of the run in it:

    column        type            meaning
    dataset       string          the prompt set
    prompt        int64           prompt index in its set (one replay stream per (dataset, prompt))
    round         int64           round index within the prompt's decoding, from 0
    num_accepted  int64           n: draft tokens accepted; rounds are verified at full γ, so this is exactly
                                  "accepted had all γ been verified" (what a replay needs)
    verified      int64           draft tokens the target verified (γ until a scheduler decodes)
    draft_s       float64         wall time of the drafter's propose() in that round (device synchronised)
    conf_logit    list<float64>   the confidence head's raw pre-sigmoid logits, positions 1..γ (empty: none)
    conf_raw      list<float64>   σ(conf_logit): the uncalibrated conditional confidences
    conf          list<float64>   the confidences the drafter reported (calibrated when calibration.json was
                                  applied; equal to conf_raw otherwise)

The schema metadata key b"dspark" holds JSON: drafter, gamma, temperature (decoding), sts_temperatures (the STS
temperatures applied to `conf`, or null).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from serving.calibration import apply_sts, sigmoid
from serving.simulator import RecordedRound

__all__ = ["load_round_arrays", "load_rounds", "write_rounds"]

_META_KEY = b"dspark"
_COLUMNS = ("dataset", "prompt", "round", "num_accepted", "verified", "draft_s", "conf_logit", "conf_raw", "conf")


def _as_lists(rows: list) -> list[list[float]]:
    return [np.asarray(r, dtype=np.float64).tolist() for r in rows]


def write_rounds(result: dict, path: str | Path) -> Path:
    """Write the "rounds" of one evaluation result (evaluation.evaluate.evaluate_many) to a Parquet file."""
    sts_temperatures = result.get("sts_temperatures")
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {c: [] for c in _COLUMNS}
    for ds, log in result["rounds"].items():
        R = len(log.num_accepted_R)
        for name, got in (("conf", len(log.conf_RK)), ("conf_logit", len(log.conf_logit_RK))):
            assert got in (0, R), f"{ds}: {name} recorded in {got} of {R} rounds (every round or none)"
        round_R, last = [], {}
        for p in log.prompt_R:
            last[p] = last.get(p, -1) + 1
            round_R.append(last[p])
        logits = _as_lists(log.conf_logit_RK) if log.conf_logit_RK else [[] for _ in range(R)]
        cols["dataset"] += [ds] * R
        cols["prompt"] += list(log.prompt_R)
        cols["round"] += round_R
        cols["num_accepted"] += list(log.num_accepted_R)
        cols["verified"] += list(log.verified_R)
        cols["draft_s"] += list(log.draft_s_R)
        cols["conf_logit"] += logits
        cols["conf_raw"] += [sigmoid(np.asarray(x)).tolist() for x in logits]
        cols["conf"] += _as_lists(log.conf_RK) if log.conf_RK else [[] for _ in range(R)]
    types = {"dataset": pa.string(), "prompt": pa.int64(), "round": pa.int64(), "num_accepted": pa.int64(),
             "verified": pa.int64(), "draft_s": pa.float64()}
    arrays = [pa.array(cols[c], type=types.get(c, pa.list_(pa.float64()))) for c in _COLUMNS]
    meta = {"drafter": result["drafter"], "gamma": result["gamma"], "temperature": result["temperature"],
            "sts_temperatures": None if sts_temperatures is None else [float(t) for t in sts_temperatures]}
    table = pa.Table.from_arrays(arrays, names=list(_COLUMNS)).replace_schema_metadata(
        {_META_KEY: json.dumps(meta).encode()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)  # a reader sees the old file or the complete new one
    return path


def _read(path: str | Path):
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"cannot read rounds file {path}: {e}") from None
    missing = [c for c in _COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"malformed rounds file {path}: missing columns {missing}")
    meta = json.loads((table.schema.metadata or {}).get(_META_KEY, b"{}"))
    return table.to_pydict(), meta


def load_round_arrays(path: str | Path) -> tuple[dict[str, dict[str, np.ndarray]], dict]:
    """-> ({dataset: {"conf_logit_NK", "num_accepted_N", "prompt_N", "draft_s_N"}}, file metadata), rows in file
    order (by prompt and round within a prompt): the arrays serving.calibration.fit_sts takes."""
    cols, meta = _read(path)
    out: dict[str, dict[str, np.ndarray]] = {}
    for ds in dict.fromkeys(cols["dataset"]):
        idx = [i for i, d in enumerate(cols["dataset"]) if d == ds]
        logits = [cols["conf_logit"][i] for i in idx]
        K = {len(x) for x in logits}
        if K == {0}:
            raise ValueError(f"{path}: dataset {ds!r} has no confidence logits (a drafter without a confidence "
                             "head, or one that reports no logits)")
        if len(K) != 1:
            raise ValueError(f"{path}: dataset {ds!r} has rounds with different numbers of positions {sorted(K)}")
        out[ds] = {"conf_logit_NK": np.asarray(logits, dtype=np.float64),
                   "num_accepted_N": np.asarray([cols["num_accepted"][i] for i in idx], dtype=np.int64),
                   "prompt_N": np.asarray([cols["prompt"][i] for i in idx], dtype=np.int64),
                   "draft_s_N": np.asarray([cols["draft_s"][i] for i in idx], dtype=np.float64)}
    return out, meta


def load_rounds(path: str | Path, temperatures=None, calibrated: bool = True
                ) -> dict[str, list[list[RecordedRound]]]:
    """rounds.parquet -> {dataset: one stream of RecordedRound per prompt, rounds in decoding order}.

    The confidences of each RecordedRound: `apply_sts(conf_logit, temperatures)` when temperatures are given (e.g.
    a calibration fitted after the recording); else the recorded `conf` (what the drafter reported, calibrated
    if it was) when `calibrated`, or the raw `conf_raw`.
    """
    cols, _ = _read(path)
    if temperatures is not None:
        confs = [apply_sts(np.asarray(x), temperatures).tolist() if x else [] for x in cols["conf_logit"]]
    else:
        confs = cols["conf" if calibrated else "conf_raw"]
    streams: dict[str, dict[int, list[tuple[int, RecordedRound]]]] = {}
    for ds, p, r, n, c in zip(cols["dataset"], cols["prompt"], cols["round"], cols["num_accepted"], confs):
        if not c:
            raise ValueError(f"{path}: dataset {ds!r} prompt {p} round {r} has no confidences to replay")
        streams.setdefault(ds, {}).setdefault(p, []).append((r, RecordedRound(tuple(c), int(n))))
    return {ds: [[rnd for _, rnd in sorted(by_prompt[p], key=lambda x: x[0])] for p in sorted(by_prompt)]
            for ds, by_prompt in streams.items()}
