"""Tests of block drafting and speculative verification (draft_model/sampling.py).

The losslessness tests run 2e5 draft-then-verify rounds at once (batched over draws) and compare the joint law of
the first two emitted tokens with the target's by a chi-square test; biased verifiers must fail the same test.

Run: python -m pytest tests/test_sampling.py -q
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from draft_model import sampling
from draft_model.sampling import (
    ACCEPTED,
    NOT_REACHED,
    PAD,
    REJECTED,
    probs_at_temperature,
    sample_block,
    verify_block,
    verify_greedy,
)

V, K, RANK = 6, 3, 2
DRAWS = 200_000
CTX = (1, 4)  # (x_{-1}, anchor x_0): the prefix the target's 2nd-order chain conditions on


def make_world(seed: int):
    """A target that is a random 2nd-order Markov chain and a Markov-head draft that is not the target."""
    g = torch.Generator().manual_seed(seed)
    target_VVV = torch.randn(V, V, V, generator=g) * 1.2  # logits of x_t given (x_{t-2}, x_{t-1})
    base_KV = torch.randn(K, V, generator=g)  # the draft backbone's per-slot logits
    w1_VR, w2_RV = torch.randn(V, RANK, generator=g), torch.randn(RANK, V, generator=g)
    return target_VVV, base_KV, w1_VR, w2_RV


def chi2_pvalue(samples_B: torch.Tensor, probs_C: torch.Tensor) -> float:
    """Chi-square goodness of fit of categorical samples; cells with expected count < 5 are pooled."""
    counts = torch.bincount(samples_B, minlength=probs_C.numel()).double()
    expected = probs_C.double() * samples_B.numel()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    if expected[-1] == 0:
        counts, expected = counts[:-1], expected[:-1]
    return float(chisquare(counts.numpy(), expected.numpy() * counts.sum().item() / expected.sum().item()).pvalue)


def one_round_first_two_tokens(seed: int, temperature: float) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One draft-then-verify round per draw; returns (p-value, first two tokens' cell index, τ)."""
    target_VVV, base_KV, w1_VR, w2_RV = make_world(seed)
    g = torch.Generator().manual_seed(seed + 1000)
    c, a = CTX

    def q(prev2_B, prev1_B):  # q: the target's next-token distribution given the last two tokens
        return probs_at_temperature(target_VVV[prev2_B, prev1_B], temperature)

    # draft: backbone logits + Markov bias W1[x_{k-1}] @ W2, sampled left to right from the anchor
    tokens_BK, p_BKV = sample_block(base_KV.expand(DRAWS, K, V), lambda k, x: w1_VR[x] @ w2_RV, a, temperature, g)
    # the target scores every draft slot (and the bonus) given the draft prefix, in "one forward"
    seq_B = torch.cat([torch.full((DRAWS, 2), c), tokens_BK], 1)
    seq_B[:, 1] = a
    q_BK1V = q(seq_B[:, :-1], seq_B[:, 1:])
    res = verify_block(tokens_BK, p_BKV, q_BK1V, g)
    y1 = res.tokens[:, 0]
    # a round that emits one token leaves the second to the next step, drawn from the target given the new prefix
    y2_next = torch.multinomial(q(torch.full_like(y1, a), y1), 1, generator=g).squeeze(-1)
    y2 = torch.where(res.num_accepted >= 1, res.tokens[:, 1], y2_next)
    q1_V = q(torch.tensor(c), torch.tensor(a))
    joint_VV = q1_V[:, None] * q(torch.full((V,), a), torch.arange(V))  # P(y1, y2) = q(y1|c,a) q(y2|a,y1)
    return chi2_pvalue(y1 * V + y2, joint_VV.flatten()), y1 * V + y2, res.tau


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_output_distribution_equals_target(temperature):
    pvalue, _, tau = one_round_first_two_tokens(seed=0, temperature=temperature)
    assert pvalue > 1e-3
    # the draft is neither useless nor the target: rounds both accept and reject
    assert 1.2 < tau.double().mean() < K + 0.8


@pytest.mark.parametrize("bias", ["accept_too_often", "residual_from_q"])
def test_biased_verifier_fails_the_same_test(monkeypatch, bias):
    if bias == "accept_too_often":
        monkeypatch.setattr(sampling, "_accept", lambda p_x, q_x, u: u * p_x < 1.5 * q_x)
    else:
        monkeypatch.setattr(sampling, "_residual", lambda q_BV, p_BV: q_BV)
    for temperature in (1.0, 0.7):
        pvalue, _, _ = one_round_first_two_tokens(seed=0, temperature=temperature)
        assert pvalue < 1e-6, (bias, temperature, pvalue)


def test_greedy_emits_the_target_argmax_continuation():
    target_VVV, _, _, _ = make_world(seed=3)
    g = torch.Generator().manual_seed(3)
    c, a = CTX
    greedy = [c, a]  # the target's own greedy rollout from the context
    for _ in range(K + 1):
        greedy.append(int(target_VVV[greedy[-2], greedy[-1]].argmax()))
    truth_K1 = torch.tensor(greedy[2:])
    B = 4000
    # drafts that follow the greedy path for a random number of slots, then deviate
    agree_B = torch.randint(0, K + 1, (B,), generator=g)
    noise_BK = torch.randint(1, V, (B, K), generator=g)
    k_K = torch.arange(K)
    draft_BK = torch.where(k_K < agree_B[:, None], truth_K1[:K], (truth_K1[:K] + noise_BK) % V)
    seq_B = torch.cat([torch.tensor(CTX).expand(B, 2), draft_BK], 1)
    res = verify_greedy(draft_BK, target_VVV[seq_B[:, :-1], seq_B[:, 1:]])
    assert torch.equal(res.num_accepted, agree_B)
    for b in range(0, B, 97):
        n = int(agree_B[b])
        assert res.tokens[b, : n + 1].tolist() == greedy[2 : 3 + n]
        assert (res.tokens[b, n + 1 :] == PAD).all()
    # T = 0 through the general rule (one-hot probabilities) is the same thing
    p_BKV = probs_at_temperature(torch.randn(B, K, V, generator=g), 0.0)
    draft_BK = p_BKV.argmax(-1)
    seq_B = torch.cat([torch.tensor(CTX).expand(B, 2), draft_BK], 1)
    logits = target_VVV[seq_B[:, :-1], seq_B[:, 1:]]
    general = verify_block(draft_BK, p_BKV, probs_at_temperature(logits, 0.0), g)
    greedy_res = verify_greedy(draft_BK, logits)
    assert torch.equal(general.tokens, greedy_res.tokens) and torch.equal(general.accepted_K, greedy_res.accepted_K)


def test_draft_equal_to_target_accepts_everything():
    g = torch.Generator().manual_seed(4)
    chain_VV = torch.randn(V, V, generator=g)  # a 1st-order target the Markov head can represent exactly
    B = 5000
    tokens_BK, p_BKV = sample_block(torch.zeros(B, K, V), lambda k, x: chain_VV[x], CTX[1], 0.8, g)
    seq_B = torch.cat([torch.full((B, 1), CTX[1]), tokens_BK], 1)
    res = verify_block(tokens_BK, p_BKV, probs_at_temperature(chain_VV[seq_B], 0.8), g)
    assert (res.tau == K + 1).all() and (res.accepted_K == ACCEPTED).all()
    assert torch.equal(res.tokens[:, :K], tokens_BK)


def test_per_position_record_and_replacement():
    x_K = torch.tensor([2, 0, 1, 1])
    p_KV = torch.nn.functional.one_hot(x_K, 3).float()
    q_K1V = torch.tensor([[0.0, 0.0, 1.0],  # agrees with the draft: accepted surely
                          [1.0, 0.0, 0.0],  # accepted surely
                          [0.0, 0.0, 1.0],  # q(x)=0: rejected; the residual max(0, q-p) is all on token 2
                          [0.3, 0.3, 0.4],
                          [0.3, 0.3, 0.4]])
    res = verify_block(x_K, p_KV, q_K1V, torch.Generator().manual_seed(0))
    assert res.accepted_K.tolist() == [ACCEPTED, ACCEPTED, REJECTED, NOT_REACHED]
    assert res.num_accepted.item() == 2 and res.tau.item() == 3
    assert res.tokens.tolist() == [2, 0, 2, PAD, PAD] and res.token_list() == [2, 0, 2]
    assert res.accepted_K.dtype == torch.int8


def test_sample_block_shapes_and_greedy_draft():
    g = torch.Generator().manual_seed(5)
    base_KV = torch.randn(K, V, generator=g)
    w1_VR, w2_RV = torch.randn(V, RANK, generator=g), torch.randn(RANK, V, generator=g)
    tokens_K, probs_KV = sample_block(base_KV, lambda k, x: w1_VR[x] @ w2_RV, CTX[1], 0.0, g)
    prev, expect = CTX[1], []
    for k in range(K):  # T = 0: each slot is the argmax given the previous *drafted* token
        prev = int((base_KV[k] + w1_VR[prev] @ w2_RV).argmax())
        expect.append(prev)
    assert tokens_K.tolist() == expect and probs_KV.shape == (K, V)
    assert torch.equal(probs_KV.argmax(-1), tokens_K) and (probs_KV.sum(-1) == 1).all()
    tokens_K, probs_KV = sample_block(base_KV, None, 0, 1.0, g)
    torch.testing.assert_close(probs_KV, torch.softmax(base_KV, -1))
    with pytest.raises(ValueError, match="base_logits"):
        sample_block(base_KV[0], None, 0, 1.0, g)
    with pytest.raises(ValueError, match="temperature"):
        probs_at_temperature(base_KV, -1.0)


def test_shape_errors():
    x_K = torch.zeros(K, dtype=torch.long)
    p_KV = torch.full((K, V), 1.0 / V)
    with pytest.raises(ValueError, match="K\\+1"):
        verify_block(x_K, p_KV, torch.full((K, V), 1.0 / V))
    with pytest.raises(ValueError, match="K\\+1"):
        verify_greedy(x_K, torch.zeros(K, V))
    with pytest.raises(ValueError, match="single block"):
        verify_greedy(x_K[None], torch.zeros(1, K + 1, V)).token_list()


def test_sample_categorical_draws_each_row_from_its_distribution():
    g = torch.Generator().manual_seed(0)
    probs_V = torch.softmax(torch.randn(50, generator=g) * 2, -1)
    probs_V[[3, 17]] = 0.0  # impossible tokens
    n = 200_000
    draws = sampling.sample_categorical(probs_V.expand(n, -1) * 3.0, g)  # any positive total
    counts = torch.bincount(draws, minlength=50)
    assert counts[[3, 17]].sum() == 0
    keep = probs_V > 0
    want = probs_V[keep].double() / probs_V[keep].double().sum() * n
    assert chisquare(counts[keep].numpy(), want.numpy()).pvalue > 1e-3
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 49, 7]), 50).float()
    assert sampling.sample_categorical(one_hot, g).tolist() == [0, 49, 7]
    assert sampling.sample_categorical(probs_V, g).shape == ()
    for bad in (torch.zeros(2, 50), torch.full((2, 50), float("nan"))):
        with pytest.raises(RuntimeError, match="no positive finite mass"):
            sampling.sample_categorical(bad, g)
