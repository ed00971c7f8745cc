"""Recorded rounds: what the evaluator records per round, rounds.parquet, and its replay streams.

Run: python -m pytest tests/test_evaluation_rounds.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_evaluate import NO_EOS, _tiny_draft, tiny_llama

from draft_model.sampling import ACCEPTED
from evaluation.drafters import make_drafter
from evaluation.evaluate import evaluate
from evaluation.rounds import load_round_arrays, load_rounds, write_rounds
from serving.calibration import apply_sts, sigmoid
from serving.simulator import RecordedRound, simulate, static_policy
from serving.sps import SPSTable

PROMPTS = {"a": [[2, 9, 4, 4], [17, 3, 8], [5]], "b": [[1, 2, 3]]}


@pytest.fixture(scope="module")
def run():
    torch.set_num_threads(1)
    target = tiny_llama(seed=4)
    drafter = make_drafter(_tiny_draft(target, "dspark-markov"), name="mine")
    return evaluate(target, None, drafter, PROMPTS, 1.0, 14, seed=2, eos_token_ids=NO_EOS)


def test_each_round_records_n_logits_and_draft_time(run):
    for ds, log in run["rounds"].items():
        R = run["datasets"][ds]["rounds"]
        assert len(log.num_accepted_R) == len(log.conf_logit_RK) == len(log.draft_s_R) == R
        for acc_K, n, logit_K, conf_K in zip(log.accepted_RK, log.num_accepted_R, log.conf_logit_RK, log.conf_RK):
            assert n == int((acc_K == ACCEPTED).sum())  # n agrees with the verifier's per-position codes
            torch.testing.assert_close(conf_K, torch.sigmoid(logit_K))  # no calibration: reported = raw
        assert log.verified_R == [3] * R and all(t > 0 for t in log.draft_s_R)
        assert sorted(set(log.prompt_R)) == list(range(len(PROMPTS[ds])))


def test_rounds_parquet_round_trips_into_one_stream_per_prompt(run, tmp_path):
    path = write_rounds(run, tmp_path / "rounds.parquet")
    streams = load_rounds(path)
    assert set(streams) == set(PROMPTS)
    for ds, log in run["rounds"].items():
        assert len(streams[ds]) == len(PROMPTS[ds])
        flat = [r for s in streams[ds] for r in s]  # prompts in order, rounds in order: the recording order
        assert [r.num_accepted for r in flat] == log.num_accepted_R
        np.testing.assert_allclose([r.conf for r in flat], torch.stack(log.conf_RK).numpy(), rtol=1e-6)
        for stream, gen in zip(streams[ds], run["generations"][ds]):
            emitted = [r.num_accepted + 1 for r in stream]  # the last round may be cut at max_new_tokens
            assert sum(emitted[:-1]) < len(gen["tokens"]) <= sum(emitted)
    arrays, meta = load_round_arrays(path)
    assert meta == {"drafter": "mine", "gamma": 3, "temperature": 1.0, "sts_temperatures": None}
    a = arrays["a"]
    assert a["conf_logit_NK"].shape == (run["datasets"]["a"]["rounds"], 3)
    np.testing.assert_allclose(sigmoid(a["conf_logit_NK"]), [r.conf for s in streams["a"] for r in s], rtol=1e-6)
    # a calibration fitted later is applied to the recorded raw logits
    t_K = [2.0, 0.5, 1.5]
    later = load_rounds(path, temperatures=t_K)
    np.testing.assert_allclose([r.conf for s in later["a"] for r in s], apply_sts(a["conf_logit_NK"], t_K))
    # and the streams replay in the simulator
    res = simulate(streams["a"], static_policy(3), SPSTable([1, 8], [100.0, 50.0], {}), 2, lambda k: 0.0, 4)
    assert res.tokens == sum(min(r.num_accepted, 3) + 1 for r in _first_rounds(streams["a"], 2, 4))


def _first_rounds(streams: list[list[RecordedRound]], slots: int, steps: int) -> list[RecordedRound]:
    """The rounds simulate() replays in `steps` steps with `slots` slots (no stream here ends that early)."""
    assert all(len(streams[r]) >= steps for r in range(slots))
    return [streams[r][i] for r in range(slots) for i in range(steps)]


def test_unreadable_rounds_file_is_one_line(tmp_path):
    bad = tmp_path / "rounds.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match="cannot read rounds file"):
        load_rounds(bad)
