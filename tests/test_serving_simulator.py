"""Tests of the replay simulator (serving/simulator.py): exact arithmetic on hand-made rounds, replay of the
recorded τ, the async policy's staleness, sweeps and plots.

Run: python -m pytest tests/test_serving_simulator.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving import policies
from serving.simulator import (
    Policy,
    RecordedRound,
    algorithm1_policy,
    async_policy,
    engine_curve,
    pareto_plot,
    simulate,
    static_policy,
    sweep,
    threshold_policy,
    verify_len_plot,
)
from serving.sps import SPSTable

# step times 10, 20, 25, 50 ms at B = 1, 2, 4, 8 (B = 3 rounds up to 4: 25 ms)
SPS = SPSTable([1, 2, 4, 8], [100.0, 50.0, 40.0, 20.0])
S0 = [RecordedRound((0.9, 0.5), 2), RecordedRound((0.2, 0.9), 0)]  # survivals (0.9, 0.45), (0.2, 0.18)
S1 = [RecordedRound((0.6, 0.6), 1)]  # survivals (0.6, 0.36)
DRAFT_S = 0.005


def test_replay_arithmetic_by_hand():
    res = simulate([S0, S1], threshold_policy(0.5), SPS, concurrency=2, draft_time_s=lambda g: DRAFT_S,
                   num_steps=3)
    # τ = 0.5 verifies slot 1 of S0 round 0 and of S1, nothing of S0 round 1.
    # step 1: slot 0 = S0[0] (ℓ 1, n 2 → 2 tokens), slot 1 = S1[0] (ℓ 1, n 1 → 2); B = 4 → 25 ms + 5 ms.
    #         S1 ends (2 tokens in 0.030 s); S0 takes slot 1 (streams cycle).
    # step 2: slot 0 = S0[1] (ℓ 0 → 1 token), slot 1 = S0[0] (→ 2); B = 3 → rounded up to 4: 30 ms.
    #         slot 0's S0 ends (3 tokens in 0.060 s); S1 takes slot 0.
    # step 3: slot 0 = S1[0] (→ 2), slot 1 = S0[1] (→ 1); B = 3: 30 ms. Both end: 2 in 0.030 s, 3 in 0.060 s.
    assert res.tokens == 10 and res.steps == 3 and res.request_rounds == 6 and res.finished_requests == 4
    assert res.time_s == pytest.approx(0.090)
    assert res.tokens_per_s == pytest.approx(10 / 0.090)
    assert res.per_user_tokens_per_s == pytest.approx(np.mean([2 / 0.03, 3 / 0.06, 2 / 0.03, 3 / 0.06]))
    assert res.mean_verify_len == pytest.approx(4 / 6)
    assert res.mean_batch_tokens == pytest.approx(10 / 3)
    assert res.tau == pytest.approx(10 / 6)


def test_static_gamma_drafts_gamma_positions_and_counts_unfinished_requests():
    drafted = []
    res = simulate([S0], static_policy(1), SPS, concurrency=1, draft_time_s=lambda g: drafted.append(g) or 0.001,
                   num_steps=3)
    assert drafted == [1]  # static γ drafts γ positions (the same every step: asked once)
    # ℓ = 1, B = 2 → 20 ms + 1 ms per step; tokens min(2, 1) + 1 = 2, min(0, 1) + 1 = 1, then S0[0] again: 2
    assert res.tokens == 5 and res.time_s == pytest.approx(0.063)
    # finished: 3 tokens in 0.042 s; still running at the horizon: 2 tokens in 0.021 s
    assert res.finished_requests == 1
    assert res.per_user_tokens_per_s == pytest.approx((3 / 0.042 + 2 / 0.021) / 2)
    drafted.clear()
    simulate([S0], algorithm1_policy(), SPS, 1, lambda g: drafted.append(g) or 0.0, num_steps=2)
    assert drafted == [2]  # the confidence policies draft every position


def random_streams(seed: int, num: int, length: int, K: int = 5) -> list[list[RecordedRound]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        c_TK = 1 / (1 + np.exp(-rng.normal(1.0, 1.5, size=(length, K))))
        n_T = np.cumprod(rng.random((length, K)) < c_TK, axis=1).sum(1)
        out.append([RecordedRound(tuple(c), int(n)) for c, n in zip(c_TK, n_T)])
    return out


def test_static_full_gamma_reproduces_the_recorded_tau():
    streams = random_streams(0, num=4, length=30)
    recorded_tau = np.mean([rnd.num_accepted + 1 for s in streams for rnd in s])
    res = simulate(streams, static_policy(5), SPS, concurrency=1, draft_time_s=lambda g: 0.0, num_steps=120)
    assert res.tau == recorded_tau and res.finished_requests == 4 and res.mean_verify_len == 5
    # the same with four slots replaying the four equal-length streams side by side
    res4 = simulate(streams, static_policy(5), SPS, concurrency=4, draft_time_s=lambda g: 0.0, num_steps=30)
    assert res4.tau == recorded_tau and res4.mean_batch_tokens == 24


def test_async_policy_sees_confidences_two_steps_old():
    seen = []

    def spy(conf_RK, stale_RK, sps):
        seen.append((conf_RK.copy(), stale_RK.copy()))
        return np.zeros(conf_RK.shape[0], dtype=np.int64)

    stream = [RecordedRound((0.1 * (i + 1), 0.5), 0) for i in range(5)]
    simulate([stream], Policy("spy", spy), SPS, concurrency=1, draft_time_s=lambda g: 0.0, num_steps=5)
    c1 = [round(float(cur[0, 0]), 6) for cur, _ in seen]
    stale1 = [round(float(st[0, 0]), 6) for _, st in seen]
    assert c1 == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert np.isnan(stale1[:2]).all() and stale1[2:] == [0.1, 0.2, 0.3]  # none at steps 1-2, then two steps old


def test_async_policy_matches_its_parts():
    # confident early rounds, doubtful late ones: the stale capacity at step 3 is that of the confident step 1
    streams = [[RecordedRound((0.95 - 0.01 * r,) * 5, 5 - r), RecordedRound((0.7,) * 5, r),
                RecordedRound((0.3 + 0.05 * r,) * 5, r % 2)] for r in range(4)]
    sps = SPSTable([4, 8, 12, 16, 24], [100.0, 98.0, 90.0, 70.0, 50.0])
    res = simulate(streams, async_policy(), sps, concurrency=4, draft_time_s=lambda g: 0.0, num_steps=3)
    # slot r replays stream r; steps 1-2 have no stale confidences (Algorithm 1 with its stop), step 3 uses step 1's
    conf = [np.array([streams[r][t].conf for r in range(4)]) for t in range(3)]
    n = [np.array([streams[r][t].num_accepted for r in range(4)]) for t in range(3)]
    ell = [policies.algorithm1(conf[0], sps), policies.algorithm1(conf[1], sps),
           policies.async_allocate(conf[2], policies.async_capacity(conf[0], sps))]
    assert res.mean_verify_len == sum(e.sum() for e in ell) / 12
    assert res.tokens == sum(int((np.minimum(n[t], ell[t]) + 1).sum()) for t in range(3))
    assert res.time_s == pytest.approx(sum(sps.step_time(int((e + 1).sum())) for e in ell))
    # at step 3 the stale capacity is not the one current confidences would give (the case that matters)
    assert policies.async_capacity(conf[0], sps) != policies.async_capacity(conf[2], sps)


def test_sweep_verifies_less_at_high_concurrency():
    # flat up to 16 tokens, then step time proportional to tokens: a GPU-like curve in miniature
    sizes = np.arange(1, 1025)
    sps = SPSTable(sizes, np.where(sizes <= 16, 100.0, 1600.0 / sizes))
    streams = random_streams(2, num=6, length=40)
    res = sweep(streams, [algorithm1_policy(), static_policy(5)], sps, [2, 64], lambda g: 0.0, num_steps=40)
    assert [(r.policy, r.concurrency) for r in res] == [("Algorithm 1", 2), ("Algorithm 1", 64),
                                                       ("static γ=5", 2), ("static γ=5", 64)]
    assert res[0].mean_verify_len == 5  # B = 2·6 = 12 ≤ 16: verifying all is free
    assert res[1].mean_verify_len == 0  # B ≥ 64: every verified token costs its full share of the step
    assert res[1].tokens_per_s > res[3].tokens_per_s  # and that beats static γ = K there
    assert res[0].tokens_per_s == pytest.approx(res[2].tokens_per_s)


def test_bad_input():
    with pytest.raises(ValueError, match="num_accepted must be in 0..2"):
        RecordedRound((0.5, 0.5), 3)
    with pytest.raises(ValueError, match="same number of draft positions"):
        simulate([S0, [RecordedRound((0.5,), 0)]], static_policy(1), SPS, 1, lambda g: 0.0, 1)
    with pytest.raises(ValueError, match="at least one recorded round"):
        simulate([S0, []], static_policy(1), SPS, 1, lambda g: 0.0, 1)
    bad = Policy("bad", lambda c, s, sps: np.full(c.shape[0], 7))
    with pytest.raises(ValueError, match="policy 'bad' returned"):
        simulate([S0], bad, SPS, 1, lambda g: 0.0, 1)


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    res = sweep(random_streams(3, 4, 10), [algorithm1_policy(), static_policy(3)], SPS, [1, 2, 4],
                lambda g: 0.001, num_steps=10)
    for path in (pareto_plot(res, tmp_path / "pareto.png"), verify_len_plot(res, tmp_path / "ell.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serving_is_pure():
    # the serving package must import without ray, deepspeed, torch.distributed (and needs no torch at all)
    code = ("import sys, serving.calibration, serving.sps, serving.policies, serving.simulator; "
            "print(sorted(m for m in ('ray', 'deepspeed', 'torch', 'torch.distributed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


def test_policies_plan_with_the_whole_engine_step():
    """A step costs the target's verify plus the drafting; Algorithm 1 is given that curve, so a fixed drafting
    cost makes it verify more (each step's overhead is shared by more tokens) and never loses to planning
    without it."""
    sps = SPSTable([1, 2, 4, 8, 16], [100.0, 60.0, 40.0, 25.0, 14.0])  # a steep, CPU-like curve
    curve = engine_curve(sps, 0.02)
    B = np.array([1, 3, 16])
    assert np.allclose(curve(B), 1.0 / (sps.step_time(B) + 0.02))
    streams = random_streams(3, num=6, length=60)

    def planned_without_drafting(c, s, engine_sps):
        return policies.algorithm1(c, sps)

    naive = Policy("Algorithm 1 on the target's curve", planned_without_drafting)
    fast, slow = (simulate(streams, algorithm1_policy(), sps, 4, lambda g, d=d: d, 60) for d in (0.0, 0.05))
    blind = simulate(streams, naive, sps, 4, lambda g: 0.05, 60)
    assert slow.mean_verify_len > fast.mean_verify_len
    assert blind.mean_verify_len == pytest.approx(fast.mean_verify_len)  # the same plan as with free drafting
    assert slow.tokens_per_s >= blind.tokens_per_s
    with pytest.raises(ValueError, match="draft time"):
        simulate(streams, algorithm1_policy(), sps, 2, lambda g: -1.0, 5)
