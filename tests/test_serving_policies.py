"""Tests of the verification-length policies (serving/policies.py), including the paper's counterexample that
shows why Algorithm 1 must stop at the first drop, run with real speculative sampling (draft_model.sampling).

Run: python -m pytest tests/test_serving_policies.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draft_model.sampling import sample_block, verify_block
from serving.policies import (
    algorithm1,
    async_allocate,
    async_capacity,
    asynchronous,
    rank_slots,
    static_gamma,
    theta_curve,
    threshold,
)
from serving.sps import SPSTable

# ---- the counterexample (DESIGN.md §1) ------------------------------------------------------------------------
# One request, γ = 2, SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45 (B = tokens verified = ℓ + 1), vocabulary {0, 1}.
# Position 1: target q1 = (0.7, 0.3), draft p1 = (0.5, 0.5); the draft's confidence in slot 1 is c1 = 0.8.
# Position 2: the draft's confidence is c2 = 0.9 if it sampled x1 = 0, else 0. The distributions at position 2
# only matter for the tokens after the first; fixed here as q2 = (0.6, 0.4), p2 = (0.5, 0.5), bonus q3 = (0.5, 0.5)
# (the same in every path). "Output distribution" = the law of the FIRST token emitted after the anchor.
#
# Θ after admitting m slots (a_1 = 0.8, a_2 = 0.8·c2):
#   m = 0: τ* = 1,        B = 1: Θ = 1.0                              (Θ_best)
#   m = 1: τ* = 1.8,      B = 2: Θ = 0.9    < 1.0 → Algorithm 1 stops: ℓ = 0 whatever x1 is
#   m = 2: τ* = 1 + 0.8 + 0.8·c2, B = 3: Θ = 0.45·(1.8 + 0.72) = 1.134 if x1 = 0, 0.45·1.8 = 0.81 if x1 = 1
# Searching past the drop therefore verifies ℓ = 2 exactly when x1 = 0 and ℓ = 0 when x1 = 1:
#   x1 = 0 (prob 0.5): verified, accepted with min(1, 0.7/0.5) = 1 → first token 0
#   x1 = 1 (prob 0.5): nothing verified, the target's own sample: 0 w.p. 0.7, 1 w.p. 0.3
#   P(first = 0) = 0.5·1 + 0.5·0.7 = 0.85, P(first = 1) = 0.5·0.3 = 0.15, not the target's (0.7, 0.3).
# With the stop, ℓ = 0 always and the first token is the target's sample. The asynchronous variant's capacity
# comes from an earlier round's confidences (x1' drawn independently of the current x1): capacity 2 or 0 with
# probability 1/2 each, independent of x1, so the first token is (0.7, 0.3) either way.

SPS_CE = SPSTable([1, 2, 3], [1.0, 0.5, 0.45])
DRAWS = 200_000
P_DRAFT_KV = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
Q_TARGET_K1V = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
BIASED = (0.85, 0.15)


def ce_confidences(x1_D: torch.Tensor) -> np.ndarray:
    """conf_D2 of the counterexample: c1 = 0.8, c2 = 0.9 if the draft sampled x1 = 0 else 0."""
    c2_D = np.where(x1_D.numpy() == 0, 0.9, 0.0)
    return np.stack([np.full_like(c2_D, 0.8), c2_D], 1)


def per_draw(policy, conf_D2: np.ndarray) -> np.ndarray:
    """ℓ for every draw, each draw one request (R = 1); the policy is evaluated once per distinct input row."""
    rows_U2, inverse_D = np.unique(conf_D2, axis=0, return_inverse=True)
    ell_U = np.array([int(policy(row[None])[0]) for row in rows_U2])
    return ell_U[inverse_D.ravel()]


def first_tokens(ell_D: np.ndarray, tokens_DK: torch.Tensor, probs_DKV: torch.Tensor,
                 g: torch.Generator) -> torch.Tensor:
    """The first emitted token of each draw when its first ℓ draft tokens are verified (speculative sampling)."""
    first_D = torch.empty(ell_D.size, dtype=torch.long)
    for ell in np.unique(ell_D):
        idx = torch.from_numpy(np.flatnonzero(ell_D == ell))
        q_D1V = Q_TARGET_K1V[: ell + 1].expand(idx.numel(), ell + 1, 2)
        if ell == 0:  # no draft token verified: the target's step emits its own sample
            first_D[idx] = torch.multinomial(q_D1V[:, 0], 1, generator=g).squeeze(-1)
        else:
            res = verify_block(tokens_DK[idx, :ell], probs_DKV[idx, :ell], q_D1V, g)
            first_D[idx] = res.tokens[:, 0]
    return first_D


def run_counterexample(choose, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """Draft, choose ℓ by `choose(current conf_D2, stale conf_D2)`, verify. Returns (ℓ_D, first-token freq, p)."""
    g = torch.Generator().manual_seed(seed)
    base_DKV = P_DRAFT_KV.log().expand(DRAWS, 2, 2)
    tokens_DK, probs_DKV = sample_block(base_DKV, None, 0, 1.0, g)
    stale_x1_D, _ = sample_block(base_DKV, None, 0, 1.0, g)  # an earlier round, independent of this draft
    ell_D = choose(ce_confidences(tokens_DK[:, 0]), ce_confidences(stale_x1_D[:, 0]))
    counts = torch.bincount(first_tokens(ell_D, tokens_DK, probs_DKV, g), minlength=2).numpy()
    pvalue = float(chisquare(counts, np.array([0.7, 0.3]) * DRAWS).pvalue)
    return ell_D, counts / DRAWS, pvalue


def test_counterexample_theta_values():
    np.testing.assert_allclose(theta_curve([[0.8, 0.9]], SPS_CE)[0], [1.0, 0.9, 1.134])
    np.testing.assert_allclose(theta_curve([[0.8, 0.0]], SPS_CE)[0], [1.0, 0.9, 0.81])
    assert algorithm1([[0.8, 0.9]], SPS_CE).tolist() == [0]
    assert algorithm1([[0.8, 0.9]], SPS_CE, early_stop=False).tolist() == [2]
    assert algorithm1([[0.8, 0.0]], SPS_CE, early_stop=False).tolist() == [0]


def test_algorithm1_with_early_stop_is_lossless():
    ell_D, freq, pvalue = run_counterexample(lambda cur, stale: per_draw(lambda c: algorithm1(c, SPS_CE), cur))
    assert (ell_D == 0).all()
    assert pvalue > 1e-3, (freq, pvalue)


def test_search_past_the_drop_is_biased():
    ell_D, freq, pvalue = run_counterexample(
        lambda cur, stale: per_draw(lambda c: algorithm1(c, SPS_CE, early_stop=False), cur))
    assert set(np.unique(ell_D)) == {0, 2}
    np.testing.assert_allclose(freq, BIASED, atol=0.004)  # 4 standard errors at 2e5 draws
    assert pvalue < 1e-3


def test_async_variant_with_stale_capacity_is_lossless():
    def choose(cur_D2, stale_D2):
        cap_D = per_draw(lambda c: [async_capacity(c, SPS_CE)], stale_D2)  # from the earlier round only
        # allocate the capacity over the current slots: row = (c1, c2, capacity)
        return per_draw(lambda row: async_allocate(row[:, :2], int(row[0, 2])), np.c_[cur_D2, cap_D])

    ell_D, freq, pvalue = run_counterexample(choose)
    assert 0.49 < (ell_D == 2).mean() < 0.51  # verifies in about half the draws: the test is not vacuous
    assert pvalue > 1e-3, (freq, pvalue)


def test_async_variant_needs_stale_values():
    # the same policy fed the CURRENT confidences as its "stale" input is the search past the drop again
    ell_D, freq, pvalue = run_counterexample(
        lambda cur, stale: per_draw(lambda c: async_allocate(c, async_capacity(c, SPS_CE)), cur))
    np.testing.assert_allclose(freq, BIASED, atol=0.004)
    assert pvalue < 1e-3


def test_async_fallback_without_stale_values_is_lossless():
    # a request's first two steps: no stale row (NaN) -> Algorithm 1 with its stop on the current values
    ell_D, freq, pvalue = run_counterexample(
        lambda cur, stale: per_draw(lambda c: asynchronous(c, np.full_like(c, np.nan), SPS_CE), cur))
    assert (ell_D == 0).all()
    assert pvalue > 1e-3, (freq, pvalue)


def test_asynchronous_is_its_parts_and_falls_back_when_any_row_lacks_stale_values():
    conf = np.array([[0.9, 0.8, 0.2], [0.6, 0.95, 0.9]])
    stale = np.array([[0.99, 0.99, 0.99], [0.1, 0.1, 0.1]])
    assert asynchronous(conf, stale, SPS_CE).tolist() == async_allocate(conf, async_capacity(stale, SPS_CE)).tolist()
    one_missing = stale.copy()
    one_missing[1] = np.nan
    assert asynchronous(conf, one_missing, SPS_CE).tolist() == algorithm1(conf, SPS_CE).tolist()
    with pytest.raises(ValueError, match="stale confidences must have"):
        asynchronous(conf, stale[:1], SPS_CE)


# ---- semantics --------------------------------------------------------------------------------------------------


def algorithm1_reference(conf_RK: np.ndarray, sps) -> list[int]:
    """Algorithm 1 written literally from DESIGN.md, one slot at a time (the vectorised version must agree)."""
    R, K = conf_RK.shape
    a = np.cumprod(conf_RK, axis=1)
    cands = sorted(((a[r, j], j, r) for r in range(R) for j in range(K)), key=lambda t: (-t[0], t[1], t[2]))
    ell, B, tau, best = [0] * R, R, float(R), R * sps(R)
    for a_rj, j, r in cands:
        theta = (tau + a_rj) * sps(B + 1)
        if not theta > best:
            break
        ell[r], B, tau, best = j + 1, B + 1, tau + a_rj, theta
    return ell


def random_conf(seed: int, R: int = 12, K: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 1 / (1 + np.exp(-rng.normal(1.5, 1.5, size=(R, K))))


GPU_LIKE = SPSTable([16, 32, 48, 64, 96, 128], [100.0, 99.0, 97.0, 80.0, 60.0, 45.0])  # flat, then steps down


@pytest.mark.parametrize("seed", range(5))
def test_algorithm1_matches_the_literal_loop(seed):
    conf = random_conf(seed)
    assert algorithm1(conf, GPU_LIKE).tolist() == algorithm1_reference(conf, GPU_LIKE)


@pytest.mark.parametrize("seed", range(3))
def test_algorithm1_admits_a_prefix_of_the_survival_ranking(seed):
    conf = random_conf(seed, R=20, K=7)
    ell = algorithm1(conf, GPU_LIKE)
    a_RK = np.cumprod(conf, axis=1)
    admitted_RK = np.arange(1, 8)[None, :] <= ell[:, None]  # per request: slots 1..ℓ_r
    assert 0 < admitted_RK.sum() < admitted_RK.size  # this table gives a non-trivial cut
    assert a_RK[admitted_RK].min() >= a_RK[~admitted_RK].max()  # every admitted slot outranks every other one


def test_flat_sps_verifies_everything():
    flat = SPSTable([1, 4096], [50.0, 50.0])
    conf = random_conf(0)
    assert algorithm1(conf, flat).tolist() == [6] * 12
    assert async_allocate(conf, async_capacity(conf, flat)).tolist() == [6] * 12


def test_steep_sps_verifies_little():
    sizes = np.arange(1, 200)
    cpu_like = SPSTable(sizes, 1000.0 / sizes)  # step time proportional to tokens: any a < 1 lowers Θ
    assert algorithm1(random_conf(0), cpu_like).sum() == 0
    # moderately steep (time grows half as fast as tokens): only the most confident slots pass
    half = SPSTable(sizes, 1000.0 / (12 + 0.5 * sizes))
    ell = algorithm1(random_conf(0), half)
    assert 0 < ell.sum() < algorithm1(random_conf(0), GPU_LIKE).sum()
    assert np.cumprod(random_conf(0), 1)[np.arange(1, 7)[None] <= ell[:, None]].min() > 0.5


def test_ties_are_deterministic_and_prefix_preserving():
    conf = np.array([[1.0, 1.0, 0.5], [1.0, 1.0, 0.5]])
    a_M, r_M, j_M = rank_slots(conf)
    assert list(zip(r_M.tolist(), j_M.tolist())) == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    np.testing.assert_array_equal(a_M, [1, 1, 1, 1, 0.5, 0.5])
    assert async_allocate(conf, 3).tolist() == [2, 1]
    assert async_allocate(conf, 100).tolist() == [3, 3]  # capacity above R·K is all of it
    zeros = np.zeros((3, 4))  # all survivals tie at 0: still per-request prefixes, position-major
    assert async_allocate(zeros, 5).tolist() == [2, 2, 1]


def test_threshold_and_static_semantics():
    conf = np.array([[0.9, 0.9, 0.9], [0.5, 0.9, 0.9], [1.0, 1.0, 0.2]])
    # survivals: [0.9, 0.81, 0.729], [0.5, 0.45, 0.405], [1, 1, 0.2]
    assert threshold(conf, 0.8).tolist() == [2, 0, 2]
    assert threshold(conf, 0.45).tolist() == [3, 2, 2]
    assert threshold(conf, 0.0).tolist() == [3, 3, 3]
    assert threshold(conf, 1.0).tolist() == [0, 0, 2]
    assert static_gamma(conf, 2).tolist() == [2, 2, 2]
    assert static_gamma(conf, 0).tolist() == [0, 0, 0]


def test_async_capacity_searches_the_stale_values_past_drops():
    assert async_capacity([[0.8, 0.9]], SPS_CE) == 2  # Algorithm 1 with the stop would give 0
    conf = random_conf(3)
    assert async_capacity(conf, GPU_LIKE) == int(algorithm1(conf, GPU_LIKE, early_stop=False).sum())


@pytest.mark.parametrize("call, match", [
    (lambda: algorithm1(np.full((2, 3), 1.5), GPU_LIKE), r"in \[0, 1\]"),
    (lambda: algorithm1(np.array([0.5, 0.5]), GPU_LIKE), r"\[R requests, K positions\]"),
    (lambda: threshold(np.array([[0.5, np.nan]]), 0.5), r"in \[0, 1\]"),
    (lambda: threshold(np.full((2, 3), 0.5), 1.5), "tau must be"),
    (lambda: static_gamma(np.full((2, 3), 0.5), 4), r"gamma must be an integer in 0..K=3"),
    (lambda: async_allocate(np.full((2, 3), 0.5), -1), "capacity must be"),
    (lambda: algorithm1(np.zeros((0, 3)), GPU_LIKE), "R >= 1"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match) as exc:
        call()
    assert "\n" not in str(exc.value)
