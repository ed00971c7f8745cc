"""vLLM 0.32.0's adaptive-verification rule as our pure-NumPy policy (serving.policies.vllm_budget / vllm_admit /
vllm_adaptive, serving.sps.vllm_cost_tables, serving.simulator.vllm_policy), on hand-computed cases. That these
agree with vLLM's own code is tests/test_scheduler_vllm.py (`-m vllm`).

    python -m pytest -q tests/test_vllm_rule.py
"""

from __future__ import annotations

import numpy as np
import pytest

from serving import policies as pol
from serving import simulator as sim
from serving.sps import SPSTable, vllm_cost_curves, vllm_cost_tables

STALE_RK = np.array([[0.9, 0.8, 0.5], [0.6, 0.9, 0.9]])  # survivals .9 .72 .36 / .6 .54 .486


def test_cost_tables_step_below_the_limit_and_extrapolated_above_the_last_size():
    draft, verify = vllm_cost_tables([(1, 2.0)], [(1, 10.0), (4, 10.0), (8, 14.0)], 3, 12, 8)
    assert draft.tolist() == [2.0, 2.0, 2.0, 2.0]  # one point: constant
    # sizes 0..4 pad to 4 (10 ms), 5..8 to 8 (14 ms), then 14 + 1 ms per token (slope of the last two points)
    assert verify.tolist() == [10.0] * 5 + [14.0] * 4 + [15.0, 16.0, 17.0, 18.0]


def test_cost_tables_are_made_non_decreasing_interpolated_above_the_limit_and_clamped():
    _, verify = vllm_cost_tables([(1, 0.0)], [(1, 5.0), (2, 4.0), (4, 10.0), (8, 18.0)], 1, 10, 2)
    # running maximum 5 5 10 18; up to the limit 2: step (0, 1 -> 5; 2 -> 5); above it: interpolation between the
    # points above the limit (4, 10) and (8, 18), held at 10 below 4; past 8: slope 2 per token
    assert verify.tolist() == [5.0, 5.0, 5.0, 10.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0]
    draft, verify = vllm_cost_tables([(1, -1.0)], [(1, 0.0)], 1, 2)
    assert draft.tolist() == [0.0, 0.0] and verify.tolist() == [1e-6] * 3


def test_cost_curves_of_an_sps_table_are_its_step_times_in_ms():
    table = SPSTable([1, 4, 8], [100.0, 100.0, 50.0])
    draft, verify = vllm_cost_curves(table, 0.002)
    assert draft == [(1, 2.0)] and verify == [(1, 10.0), (4, 10.0), (8, 20.0)]
    _, verify_ms = vllm_cost_tables(draft, verify, 1, 8, 8)
    assert verify_ms[1:].tolist() == (1e3 * table.step_time(np.arange(1, 9))).tolist()


def _tables(limit_tokens: int = 40):
    # 2 ms of drafting at any request count; verification 10 ms up to 5 tokens, 20 ms from 6 to 8
    return vllm_cost_tables([(1, 2.0)], [(1, 10.0), (5, 10.0), (8, 20.0)], 8, limit_tokens, 8)


def test_budget_is_the_first_argmax_of_gain_over_cost():
    draft, verify = _tables()
    # R = 2 decode requests, N = 2: b = 0..3 fit 10 ms, b = 4..6 cost 20 ms. gains 2 + cumsum(.9 .72 .6 .54 ...):
    # b = 3: 4.22 / 12 = 0.352 beats b = 6: 5.606 / 22 = 0.255 and b = 2: 3.62 / 12 = 0.302
    assert pol.vllm_budget(STALE_RK, np.array([3, 3]), np.ones(2), np.ones(2, bool), draft, verify) == 3
    # fewer scheduled drafts: only the first slot of request 1 counts (.9 .72 .36 .6): b = 3 -> 4.22 again, b = 4
    # pays 20 ms; the slots beyond a request's drafts never enter the sum
    assert pol.vllm_budget(STALE_RK, np.array([3, 1]), np.ones(2), np.ones(2, bool), draft, verify) == 3


def test_budget_counts_sampling_requests_and_prefill_tokens():
    draft, verify = _tables()
    stale = np.vstack([STALE_RK, np.ones((3, 3))])
    drafts, non_draft = np.array([3, 3, 0, 0, 0]), np.ones(5, dtype=np.int64)  # 3 prefills of 1 token, no drafts
    # N = 5 fills the 10 ms bucket: b = 1..3 cost 20 ms, b = 4..6 the extrapolated 23.3, 26.7, 30 ms (3.33 ms per
    # token past 8), plus 2 ms of drafting. S = 5 sampling: b = 0 gives 5 / 12 = 0.417, above b = 3's
    # 7.22 / 22 = 0.328; S = 2 (the prefills are partial chunks): b = 3 gives 4.22 / 22 = 0.192 > b = 0's 0.167
    assert pol.vllm_budget(stale, drafts, non_draft, np.ones(5, bool), draft, verify) == 0
    some = np.array([1, 1, 0, 0, 0], bool)
    assert pol.vllm_budget(stale, drafts, non_draft, some, draft, verify) == 3
    # the logits cap, max_total_logits - R bonus rows = 2 drafts at most: 3.62 / 22 = 0.1645 < 2 / 12 = 0.1667
    assert pol.vllm_budget(stale, drafts, non_draft, some, draft, verify, max_total_logits=7) == 0


def test_budget_refuses_tables_too_short_and_missing_stale_values():
    draft, verify = _tables(limit_tokens=6)
    with pytest.raises(ValueError, match="too short"):
        pol.vllm_budget(STALE_RK, np.array([3, 3]), np.ones(2), np.ones(2, bool), draft, verify)
    draft, verify = _tables()
    with pytest.raises(ValueError, match="ones where a request has none"):
        pol.vllm_budget(np.full((2, 3), np.nan), np.array([3, 3]), np.ones(2), np.ones(2, bool), draft, verify)


def test_admit_takes_the_top_budget_slots_of_the_current_confidences():
    # current survivals .9 .72 .36 / .6 .54 .486: the top 3 are (0,1) (0,2) (1,1)
    assert pol.vllm_admit(STALE_RK, np.array([3, 3]), 3).tolist() == [2, 1]
    assert pol.vllm_admit(STALE_RK, np.array([3, 3]), 6).tolist() == [3, 3]
    assert pol.vllm_admit(STALE_RK, np.array([3, 3]), 0).tolist() == [0, 0]
    # request 0 has one draft scheduled: its .72 slot is out of range, so (0,1) .9 and (1,1) .6 win
    assert pol.vllm_admit(STALE_RK, np.array([1, 3]), 2).tolist() == [1, 1]
    with pytest.raises(ValueError, match="budget"):
        pol.vllm_admit(STALE_RK, np.array([3, 1]), 5)


def test_admit_ranks_float32_survivals_and_breaks_ties_by_position_then_request():
    # 1 - 1e-9 and 1.0 are both 1.0 in float32: tied, so request 0 (lower index at the same position) wins,
    # although in float64 request 1's survival is larger
    conf = np.array([[1 - 1e-9, 0.5], [1.0, 0.5]])
    assert pol.vllm_admit(conf, np.array([2, 2]), 1).tolist() == [1, 0]
    assert pol.rank_slots(conf)[1][0] == 1  # our float64 ranking puts request 1 first
    tie = np.array([[0.8, 1.0], [0.8, 0.5]])  # survivals .8 .8 / .8 .4: three-way tie at .8
    assert pol.vllm_admit(tie, np.array([2, 2]), 2).tolist() == [1, 1]  # (0,1) (1,1) before (0,2)


def test_vllm_adaptive_is_budget_then_admission_for_decode_requests():
    draft, verify = _tables()
    current = np.array([[0.6, 0.9, 0.9], [0.9, 0.8, 0.5]])  # the stale rows swapped
    # budget 3 from the stale values (test above); admission by the current ones: (1,1) .9 (1,2) .72 (0,1) .6
    assert pol.vllm_adaptive(current, STALE_RK, draft, verify).tolist() == [1, 2]
    # our asynchronous policy on the same inputs, planning with the same step time (draft + verify), agrees here
    table = SPSTable([1, 5, 8], [100.0, 100.0, 50.0])
    engine = sim.engine_curve(table, 0.002)
    assert pol.asynchronous(current, STALE_RK, engine).tolist() == [1, 2]


def test_simulator_gives_the_previous_round_and_ones_or_nan_for_a_new_request():
    seen = []

    def spy(conf_RK, stale_RK, _sps):
        seen.append(stale_RK[0].tolist())
        return np.zeros(conf_RK.shape[0], dtype=np.int64)

    stream = [sim.RecordedRound((0.5, 0.4), 1), sim.RecordedRound((0.7, 0.6), 0), sim.RecordedRound((0.9, 0.8), 2)]
    table = SPSTable([1, 8], [100.0, 100.0])
    sim.simulate([stream], sim.Policy("spy", spy, stale="previous_round"), table, 1, lambda k: 0.0, 5)
    assert seen == [[1.0, 1.0], [0.5, 0.4], [0.7, 0.6], [1.0, 1.0], [0.5, 0.4]]  # the stream restarts at step 3
    seen.clear()
    sim.simulate([stream], sim.Policy("spy", spy, stale="previous_round_or_none"), table, 1, lambda k: 0.0, 4)
    assert np.isnan(seen[0]).all() and seen[1:3] == [[0.5, 0.4], [0.7, 0.6]] and np.isnan(seen[3]).all()
    with pytest.raises(ValueError, match="stale"):
        sim.Policy("bad", spy, stale="three_steps")


def test_vllm_policy_verifies_all_on_a_flat_table_and_little_on_a_steep_one():
    stream = [sim.RecordedRound((0.9, 0.8, 0.7), 2)] * 6
    flat = SPSTable([1, 64], [100.0, 100.0])
    res = sim.simulate([stream], sim.vllm_policy(flat, 0.001), flat, 4, lambda k: 0.001, 6)
    assert res.mean_verify_len == 3.0 and res.tau == 3.0  # every draft costs nothing extra: ℓ = γ, n + 1 = 3
    steep = SPSTable([4, 5], [100.0, 10.0])  # a fifth token costs 10x: 4 requests verify their anchors only
    res = sim.simulate([stream], sim.vllm_policy(steep, 0.001), steep, 4, lambda k: 0.001, 6)
    assert res.mean_verify_len == 0.0 and res.tau == 1.0
