"""bench/scheduler_vllm.py on a small synthetic rounds.parquet (seeded, written with evaluation/rounds.py's writer):
vLLM's own adaptive-verification code and our serving.policies.vllm_budget / vllm_admit agree exactly, step by
step, with prefills in the batch (cost tables, budgets, the stale confidences vLLM's buffer held, admitted drafts
per request). Needs the vLLM environment (~/.cache/dspark/vllm-0.32.0, docs/vllm-serving.md), skipped without
it; about a minute on 2 cores (importing vLLM's runner module; the admission kernel runs uncompiled, --eager).

    python -m pytest -q -m vllm tests/test_scheduler_vllm.py
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from launch_helpers import REPO, quiet_env
from scheduler_vllm import VLLM_PYTHON, agreement, engine_steps, float32_streams, survival32

from evaluation.rounds import write_rounds
from evaluation.session import RoundLog
from serving.sps import SPSTable

K = 5


def synthetic_rounds(path, prompts: int = 10, seed: int = 0):
    """Rounds of `prompts` prompts (6 to 14 rounds each): logits N(1.5, 1.5), so no confidence saturates to 1.0 in
    float32 and no two requests tie; n drawn as a draft with those confidences would be accepted."""
    g = np.random.default_rng(seed)
    log = RoundLog()
    for p in range(prompts):
        for _ in range(int(g.integers(6, 15))):
            logit = g.normal(1.5, 1.5, K)
            conf = 1 / (1 + np.exp(-logit))
            log.conf_logit_RK.append(torch.tensor(logit))
            log.conf_RK.append(torch.tensor(conf))
            log.num_accepted_R.append(int(np.argmin(np.r_[g.random(K) < conf, False])))
            log.verified_R.append(K)
            log.draft_s_R.append(0.001)
            log.prompt_R.append(p)
    return write_rounds({"rounds": {"synthetic": log}, "drafter": "synthetic", "gamma": K, "temperature": 1.0}, path)


def test_engine_steps_prefill_then_verify_with_the_previous_round_as_stale(tmp_path):
    streams = float32_streams(synthetic_rounds(tmp_path / "rounds.parquet", prompts=2), raw=True)
    steps = engine_steps(streams, 1, len(streams[0]) + 3, prefill=5, chunk=3)
    ones = (1.0,) * K
    first, second = steps[0]["rows"][0], steps[1]["rows"][0]
    assert steps[0]["add"] == [["req0", 0, 5]] and steps[1]["add"] == []
    assert (first["num_tokens"], first["drafts"], first["sampling"]) == (3, 0, False)  # a partial chunk
    assert (second["num_tokens"], second["drafts"], second["sampling"]) == (2, 0, True)  # the last: it samples
    assert steps[1]["proposed"] == [["req0", list(streams[0][0].conf)]]  # it drafts round 0
    third, fourth = steps[2]["rows"][0], steps[3]["rows"][0]
    assert (third["conf"], third["stale"], third["drafts"]) == (streams[0][0].conf, ones, K)
    assert (fourth["conf"], fourth["stale"]) == (streams[0][1].conf, streams[0][0].conf)
    last = steps[len(streams[0]) + 2]  # stream 0's rounds are done: request 1 takes the slot with a prefill
    assert last["add"] == [["req1", 0, 5]] and last["rows"][0]["drafts"] == 0


def test_agreement_tells_a_tie_broken_another_way_from_other_drafts():
    a_RK = survival32(np.array([[0.9, 0.8], [0.9, 0.5]]))  # .9 .72 / .9 .45
    assert agreement(np.array([1, 0]), np.array([1, 0]), a_RK) == "equal"
    assert agreement(np.array([1, 0]), np.array([0, 1]), a_RK) == "tie"  # .9 either way
    assert agreement(np.array([2, 0]), np.array([1, 1]), a_RK) == "other"  # .9 + .72 against .9 + .9


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_vllm_and_our_vllm_rule_admit_the_same_drafts_step_by_step(tmp_path):
    rounds = synthetic_rounds(tmp_path / "rounds.parquet")
    # a step time that grows with every bucket (10 ms at 8 tokens to 40 ms at 64), so that 6 requests' budgets
    # fall below their 30 scheduled drafts, with and without a 32-token prefill chunk in the step
    table = SPSTable([8, 16, 32, 64], [100.0, 80.0, 50.0, 25.0], {"target": "none", "dtype": "n/a",
                     "hardware": "none: a hand-made test shape", "date": "2026-12-07", "method": "by hand"})
    table.to_json(tmp_path / "table.json")
    cmd = [sys.executable, str(REPO / "bench" / "scheduler_vllm.py"), "--rounds", str(rounds), "--concurrency", "6",
           "--steps", "120", "--eager", "--sim-steps", "100", "--table", str(tmp_path / "table.json"),
           "--work-dir", str(tmp_path / "work")]
    # PYTHONPATH: this checkout's packages, whatever checkout an editable install points at
    res = subprocess.run(cmd, cwd=REPO, env=quiet_env(PYTHONPATH=str(REPO)), capture_output=True, text=True,
                         timeout=1200)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    last = res.stdout.strip().splitlines()[-1]
    num = r"\d+(?:\.\d+)?"
    m = re.fullmatch(rf"scheduler engine=vllm steps=(\d+) trimmed=(\d+) requests=6 tables_equal=(\d) "
                     rf"budget_equal=({num}) stale_equal=({num}) admitted_equal=({num}) tie_breaks=(\d+) "
                     rf"other_mismatches=(\d+) "
                     rf"async_admitted_equal=({num}) async_other_mismatches=(\d+) theta_async=({num}) "
                     rf"theta_vllm=({num})", last)
    assert m, last
    steps, trimmed = int(m.group(1)), int(m.group(2))
    assert steps == 118, last  # 120 steps but the first two: every request's two prefill chunks
    assert trimmed >= steps // 2, f"admission decided too rarely: {last}"
    assert m.group(3) == "1" and m.group(4) == m.group(5) == m.group(6) == "1.000", last
    assert m.group(7) == m.group(8) == "0", last  # no tie, no disagreement
