"""Block drafting and speculative verification (DESIGN.md §1 "Speculative sampling"), gpt-fast style.

Legend (shape suffixes):  B  independent draws / requests (optional leading axis)   K  block size γ   V  vocab
Every function takes either one block ([K, V], [K]) or a batch of them ([B, K, V], [B, K]); the batched form is
what lets the losslessness test run 1e5 rounds in one go.

Notation in the comments: p = draft probability, q = target probability (both at the same temperature T).
The rejection rule below makes the emitted tokens distributed exactly as the target's: accept draft token x_k
with probability min(1, q_k(x_k) / p_k(x_k)); at the first rejection draw from norm(max(0, q_k − p_k)); if all
γ are accepted draw a bonus token from q_{γ+1}. Every round emits num_accepted + 1 = τ tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["VerifyResult", "probs_at_temperature", "sample_block", "sample_categorical", "verify_block",
           "verify_greedy"]

PAD = -1  # VerifyResult.tokens beyond the emitted ones
ACCEPTED, REJECTED, NOT_REACHED = 1, 0, -1  # VerifyResult.accepted_K codes


@dataclass
class VerifyResult:
    tokens: Tensor  # int64 [(B,) K+1]: accepted draft tokens, then the replacement/bonus token, then PAD
    num_accepted: Tensor  # int64 [(B,)]: accepted draft tokens; τ = num_accepted + 1 tokens were emitted
    accepted_K: Tensor  # int8 [(B,) K]: ACCEPTED (1) / REJECTED (0, the first failure) / NOT_REACHED (-1)

    @property
    def tau(self) -> Tensor:
        return self.num_accepted + 1

    def token_list(self) -> list[int]:
        """The emitted tokens of an unbatched result as a Python list."""
        if self.tokens.ndim != 1:
            raise ValueError("token_list() is for a single block; index the batched tensors instead")
        return self.tokens[: int(self.num_accepted) + 1].tolist()


def probs_at_temperature(logits: Tensor, temperature: float) -> Tensor:
    """softmax(logits / T) in fp32; T = 0 is greedy: a one-hot on the argmax."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_categorical(probs_BV: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw from each row of `probs_BV` ([..., V], non-negative, any positive total) -> int64 [...].

    Inverse CDF: the first index whose float64 running sum exceeds u·total, u ~ U[0, 1). A zero-probability entry
    adds nothing to the sum, so it is never drawn; a one-hot row gives its hot index. One uniform per row instead
    of torch.multinomial's V exponentials: much faster on a CPU at a real vocabulary, where a draft samples γ times
    per round (docs/design-notes.md, "Measured kernels"). A row without positive finite mass (all zeros,
    NaN: a diverged model) is an error, as it is for torch.multinomial."""
    cdf = probs_BV.double().cumsum(-1)
    torch._assert_async((cdf[..., -1] > 0).all() & cdf[..., -1].isfinite().all(),
                        "sample_categorical: a row of probabilities has no positive finite mass")
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=torch.float64, device=cdf.device)
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).clamp_max(cdf.shape[-1] - 1).squeeze(-1)


def sample_block(base_logits_KV: Tensor, step_fn: Callable[[int, Tensor], Tensor | None] | None,
                 anchor_token: Tensor | int, temperature: float,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Draft one block left to right.

    base_logits_KV: the backbone's logits per slot ([K, V] or [B, K, V]). step_fn(k, prev_tokens) returns the
    sequential head's bias for slot k given the previous token(s) ([V] or [B, V]; None = no bias); e.g. a Markov
    head is `lambda k, x: W1[x] @ W2`. Slot 0's previous token is the anchor. Returns (tokens_K, probs_KV), the
    sampled tokens and the draft distributions p_k they were drawn from (what verify_block needs).
    """
    if base_logits_KV.ndim not in (2, 3):
        raise ValueError(f"base_logits must be [K, V] or [B, K, V], got shape {tuple(base_logits_KV.shape)}")
    single = base_logits_KV.ndim == 2
    base_BKV = base_logits_KV[None] if single else base_logits_KV
    B, K, _ = base_BKV.shape
    prev_B = torch.as_tensor(anchor_token, device=base_BKV.device).long().expand(B).clone()
    tokens, probs = [], []
    for k in range(K):  # sequential: slot k's bias depends on the token just sampled at k-1
        bias = step_fn(k, prev_B) if step_fn is not None else None
        logits_BV = base_BKV[:, k] if bias is None else base_BKV[:, k] + bias
        p_BV = probs_at_temperature(logits_BV, temperature)
        prev_B = sample_categorical(p_BV, generator)
        tokens.append(prev_B)
        probs.append(p_BV)
    tokens_BK, probs_BKV = torch.stack(tokens, 1), torch.stack(probs, 1)
    return (tokens_BK[0], probs_BKV[0]) if single else (tokens_BK, probs_BKV)


def _accept(p_x: Tensor, q_x: Tensor, u: Tensor) -> Tensor:
    # accept with prob min(1, q/p), written without the division: u < q/p  <=>  u·p < q (p > 0: x was drawn from p)
    return u * p_x < q_x


def _residual(q_BV: Tensor, p_BV: Tensor) -> Tensor:
    # where the target wants more mass than the draft gave: norm(max(0, q − p)); with p = 0 this is q itself
    r_BV = (q_BV - p_BV).clamp_min(0)
    total_B1 = r_BV.sum(-1, keepdim=True)
    # a rejection only happens where q(x) < p(x), so the residual has positive mass; the fallback to q guards
    # rounding when q ≈ p
    return torch.where(total_B1 > 0, r_BV / total_B1.clamp_min(1e-30), q_BV)


def _result(draft_BK: Tensor, n_B: Tensor, extra_B: Tensor, single: bool) -> VerifyResult:
    B, K = draft_BK.shape
    k_K = torch.arange(K + 1, device=draft_BK.device)
    tokens = torch.cat([draft_BK, draft_BK.new_full((B, 1), PAD)], 1)
    tokens = torch.where(k_K < n_B[:, None], tokens, torch.full_like(tokens, PAD))
    tokens.scatter_(1, n_B[:, None], extra_B[:, None])
    acc = torch.full((B, K), NOT_REACHED, dtype=torch.int8, device=draft_BK.device)
    acc[k_K[:K] < n_B[:, None]] = ACCEPTED
    acc[k_K[:K] == n_B[:, None]] = REJECTED
    if single:
        return VerifyResult(tokens[0], n_B[0], acc[0])
    return VerifyResult(tokens, n_B, acc)


def verify_block(draft_tokens_K: Tensor, draft_probs_KV: Tensor, target_probs_K1V: Tensor,
                 generator: torch.Generator | None = None) -> VerifyResult:
    """Speculative-sampling verification of one drafted block (T > 0; T = 0 also works with one-hot probs).

    draft_probs_KV[k] is the distribution x_k was drawn from; target_probs_K1V[k] is the target's distribution
    for the same slot given the draft prefix x_<k (computed by the caller at the same temperature, see
    probs_at_temperature), plus one row for the bonus token after all K.
    """
    single = draft_tokens_K.ndim == 1
    x_BK = draft_tokens_K[None] if single else draft_tokens_K
    p_BKV = draft_probs_KV[None] if single else draft_probs_KV
    q_BK1V = target_probs_K1V[None] if single else target_probs_K1V
    B, K = x_BK.shape
    if p_BKV.shape[:2] != (B, K) or q_BK1V.shape != (B, K + 1, p_BKV.shape[-1]):
        raise ValueError(f"shapes disagree: draft tokens {tuple(x_BK.shape)}, draft probs {tuple(p_BKV.shape)}, "
                         f"target probs {tuple(q_BK1V.shape)} (need K+1 target rows)")
    # p: draft prob, q: target prob, both of the drafted tokens
    p_x = p_BKV.gather(-1, x_BK[..., None]).squeeze(-1)
    q_x = q_BK1V[:, :K].gather(-1, x_BK[..., None]).squeeze(-1)
    u = torch.rand(B, K, generator=generator, device=x_BK.device)
    # left to right: n = number of leading accepted tokens (cumprod stops the run at the first rejection)
    n_B = torch.cumprod(_accept(p_x, q_x, u).long(), dim=1).sum(1)
    # the extra token comes from norm(max(0, q_n − p_n)); padding p with a zero row makes n = K the bonus from q_K
    p_pad = torch.cat([p_BKV, p_BKV.new_zeros(B, 1, p_BKV.shape[-1])], 1)  # (K = 0: the target samples alone)
    at_n = n_B[:, None, None].expand(B, 1, p_pad.shape[-1])
    dist_BV = _residual(q_BK1V.gather(1, at_n).squeeze(1), p_pad.gather(1, at_n).squeeze(1))
    return _result(x_BK, n_B, sample_categorical(dist_BV, generator), single)


def verify_greedy(draft_tokens_K: Tensor, target_logits_K1V: Tensor) -> VerifyResult:
    """T = 0 verification: accept while the draft equals the target's argmax, then emit the target's argmax."""
    single = draft_tokens_K.ndim == 1
    x_BK = draft_tokens_K[None] if single else draft_tokens_K
    best_BK1 = (target_logits_K1V[None] if single else target_logits_K1V).argmax(-1)
    if best_BK1.shape != (x_BK.shape[0], x_BK.shape[1] + 1):
        raise ValueError(f"target logits must have K+1 = {x_BK.shape[-1] + 1} rows per block, "
                         f"got shape {tuple(target_logits_K1V.shape)}")
    n_B = torch.cumprod((x_BK == best_BK1[:, :-1]).long(), dim=1).sum(1)
    return _result(x_BK, n_B, best_BK1.gather(1, n_B[:, None]).squeeze(1), single)
