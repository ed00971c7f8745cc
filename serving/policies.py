"""Verification-length policies (DESIGN.md §1 "Hardware-aware prefix scheduler", §3): pure functions of the
calibrated conditional confidences of the R active requests, each returning how many draft tokens of every
request the next engine step verifies.

Legend (shape suffixes):  R  active requests   K  draft positions γ   M  = R·K candidate slots (r, j), ranked

Every policy returns ell_R (int64, 0..K): request r has its draft tokens 1..ℓ_r verified, and the step emits
min(n_r, ℓ_r) + 1 tokens for it. One step verifies B = Σ_r (ℓ_r + 1) tokens (each request's anchor/bonus slot
counts) and runs at SPS(B) steps per second (serving.sps.SPSTable).

Survival a_{r,j} = Π_{i≤j} c_{r,i} is non-increasing in j, so ranking all slots by (a descending, then j, then r)
puts (r, j) before (r, j+1): any leading part of the ranking is a set of per-request prefixes. Ties are broken by
position, then request index, so the result is deterministic and still prefix-preserving.

Policies and their cost per engine step:
- static_gamma(conf_RK, γ)   ℓ_r = γ; O(R). Also MTP-1 (γ = 1).
- threshold(conf_RK, τ)      longest prefix with a_{r,j} ≥ τ; O(RK) (cumulative product, compare).
- algorithm1(conf_RK, sps)   the paper's greedy: start ℓ = 0, B = R, τ* = R, Θ_best = R·SPS(R); admit slots in
                             ranked order (B += 1, τ* += a, Θ = τ*·SPS(B)) while Θ > Θ_best; stop at the first
                             drop. One sort of R·K values, O(RK log RK), plus R·K vectorised SPS lookups.
- async_capacity(stale, sps) the production variant's budget: Algorithm 1 run on confidences two steps old,
                             O(RK log RK), off the critical path (it can run while the current step executes).
- async_allocate(conf, cap)  the top-`cap` current slots in ranked order, no early stop; O(RK log RK) (a partial
                             sort would make it O(RK)).
- asynchronous(conf, stale, sps)  the whole production variant: async_allocate(conf, async_capacity(stale)) when
                             every request has confidences two steps old; otherwise (a request's first two engine
                             steps, a row of NaN in stale_RK) Algorithm 1 with its early stop on the current ones.

Why the early stop matters (lossless speculative sampling): a_{r,j+1} depends on the token x_{r,j} the draft
sampled. A search that looks past a drop can admit x_{r,j} only because a later slot looks good, i.e. let x_{r,j}
decide its own admission, which biases the output (tests/test_serving_policies.py reproduces the paper's
counterexample: (0.85, 0.15) instead of the target's (0.7, 0.3)). `algorithm1(..., early_stop=False)` is that
unsafe search, kept only to show why. The asynchronous variant is lossless without the stop: its capacity comes
from values fixed before the current tokens exist, and a fixed-size leading part of a prefix-preserving ranking
admits (r, j) depending only on slots ranked above it, none of which depend on x_{r,j}.

The asynchronous variant's fallback. A request in its first two engine steps has no confidences two steps old.
Using the CURRENT confidences in their place (as this module's callers once did) turns async_capacity into the
unsafe search: its Algorithm 1 runs without the stop, so the capacity, and with it (r, j)'s admission, depends on
a_{r,j+1}, ..., i.e. on x_{r,j} itself (tests/test_scheduled.py measured the bias). Whenever any request lacks
stale values, `asynchronous` therefore runs Algorithm 1 WITH its early stop on the current confidences, for the
whole step. That is lossless by the early-stop argument above: the search reaches (r, j) only through slots
ranked above it, whose survivals depend on other requests' drafts and on x_{r,<j}, never on x_{r,j}, and it
decides (r, j) from Θ up to and including a_{r,j}, which depends on x_{r,<j} only. The step is then exactly
`algorithm1` (it just is not computed off the critical path); a stale-based capacity mixed with per-request
fallbacks would need its own argument, and the fallback lasts two steps per request.

vLLM's rule (vLLM 0.32.0, vllm/v1/worker/gpu/spec_decode/adaptive_verification.py; docs/vllm-scheduler.md):
- vllm_budget(stale, ...)     AdaptiveVerificationManager.get_num_tokens (:282-350): over the R scheduled requests
                              (prefills included), the survivals of the stale confidences of the slots each request
                              has drafts for, sorted; budget b = the first argmax over b = 0..cap of
                              (S + Σ top-b survivals) / (draft_ms[R] + verify_ms[N + b]), S = requests that sample
                              this step, N = their non-draft tokens (1 per decode, the chunk per prefill).
- vllm_admit(conf, drafts, b) _assign_draft_token_budget (:46-72): the top-b current slots by float32 survival.
- vllm_adaptive(conf, stale, draft_ms, verify_ms)   both, for a batch of decode requests with γ drafts each.
Its stale confidences are the request's previous round (ones in its first); it has no early-stop fallback.
Exact ties at the admission boundary across requests: torch.topk picks among them in no documented order (on
CPU it is not index order); vllm_admit takes them by position, then request, as rank_slots does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["algorithm1", "async_allocate", "async_capacity", "asynchronous", "rank_slots", "static_gamma",
           "theta_curve", "threshold", "vllm_adaptive", "vllm_admit", "vllm_budget"]

SPS = Callable[[np.ndarray], np.ndarray]  # SPS(B) steps per second, vectorised (serving.sps.SPSTable)


def _conf(conf_RK: np.ndarray) -> np.ndarray:
    c_RK = np.asarray(conf_RK, dtype=np.float64)
    if c_RK.ndim != 2 or c_RK.shape[0] == 0:
        raise ValueError(f"confidences must be [R requests, K positions] with R >= 1, got shape {c_RK.shape}")
    if not np.all((c_RK >= 0) & (c_RK <= 1)):  # also rejects NaN
        raise ValueError("confidences must be calibrated probabilities in [0, 1] (apply serving.calibration first)")
    return c_RK


def rank_slots(conf_RK: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All slots (r, j) ranked by survival descending, ties by position then request: (a_M, r_M, j_M), j 1-based."""
    return _rank_survival(np.cumprod(_conf(conf_RK), axis=1))


def _rank_survival(a_RK: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    R, K = a_RK.shape
    r_RK, j_RK = np.meshgrid(np.arange(R), np.arange(1, K + 1), indexing="ij")
    a_M, r_M, j_M = a_RK.ravel(), r_RK.ravel(), j_RK.ravel()
    order_M = np.lexsort((r_M, j_M, -a_M))  # last key is the primary one
    return a_M[order_M], r_M[order_M], j_M[order_M]


def _lengths(r_M: np.ndarray, m: int, R: int) -> np.ndarray:
    """ℓ_R from admitting the first m ranked slots (a prefix per request, by the ranking's construction)."""
    return np.bincount(r_M[:m], minlength=R).astype(np.int64)


def static_gamma(conf_RK: np.ndarray, gamma: int) -> np.ndarray:
    """Verify γ draft tokens of every request (the fixed-γ baseline; γ = 1 is MTP-1)."""
    c_RK = _conf(conf_RK)
    if not (isinstance(gamma, int | np.integer) and 0 <= gamma <= c_RK.shape[1]):
        raise ValueError(f"gamma must be an integer in 0..K={c_RK.shape[1]}, got {gamma!r}")
    return np.full(c_RK.shape[0], int(gamma), dtype=np.int64)


def threshold(conf_RK: np.ndarray, tau: float) -> np.ndarray:
    """Verify the longest prefix of each request whose survival a_{r,j} is at least τ (τ in [0, 1])."""
    c_RK = _conf(conf_RK)
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be a survival probability in [0, 1], got {tau!r}")
    # survival is non-increasing in j, so counting the slots >= τ gives the prefix length
    return (np.cumprod(c_RK, axis=1) >= tau).sum(1).astype(np.int64)


def theta_curve(conf_RK: np.ndarray, sps: SPS) -> tuple[np.ndarray, np.ndarray]:
    """Θ_m = τ*_m · SPS(R + m) after admitting the first m ranked slots, m = 0..R·K; returns (theta_M1, r_M).

    τ*_m = R + Σ of the admitted survivals is the expected number of tokens the step emits, so Θ is expected
    tokens per second of engine time.
    """
    a_M, r_M, _ = rank_slots(conf_RK)
    R = int(np.asarray(conf_RK).shape[0])
    tau_M1 = R + np.r_[0.0, np.cumsum(a_M)]
    theta_M1 = tau_M1 * np.asarray(sps(R + np.arange(a_M.size + 1)), dtype=np.float64)
    return theta_M1, r_M


def algorithm1(conf_RK: np.ndarray, sps: SPS, early_stop: bool = True) -> np.ndarray:
    """The hardware-aware prefix scheduler (Algorithm 1): ℓ_R maximising Θ greedily, stopping at the first drop.

    early_stop=False searches past drops (takes the best Θ over the whole ranking). That is UNSAFE on current
    confidences (it breaks losslessness, see the module docstring) and exists only to demonstrate why, and for
    the asynchronous variant's capacity, which runs it on stale confidences where it is safe.
    """
    theta_M1, r_M = theta_curve(conf_RK, sps)
    R = int(np.asarray(conf_RK).shape[0])
    if early_stop:
        # keep slot m while Θ_m > Θ_best = Θ_{m−1}; the first slot that does not improve ends the search
        drops = np.flatnonzero(theta_M1[1:] <= theta_M1[:-1])
        m = int(drops[0]) if drops.size else r_M.size
    else:
        m = int(np.argmax(theta_M1))  # first maximum: ties keep the shorter verification
    return _lengths(r_M, m, R)


def async_capacity(stale_conf_RK: np.ndarray, sps: SPS) -> int:
    """Total draft tokens to verify next step, from confidences two steps old: Σ ℓ of Algorithm 1 on them.

    The search runs past drops (no early stop): the stale values were fixed before any current token existed,
    so no current token can influence the capacity.
    """
    return int(algorithm1(stale_conf_RK, sps, early_stop=False).sum())


def async_allocate(conf_RK: np.ndarray, capacity: int) -> np.ndarray:
    """Give `capacity` draft slots to the current top slots by survival (prefix-preserving, no early stop)."""
    if not (isinstance(capacity, int | np.integer) and capacity >= 0):
        raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}")
    _, r_M, _ = rank_slots(conf_RK)
    return _lengths(r_M, min(int(capacity), r_M.size), int(np.asarray(conf_RK).shape[0]))


def asynchronous(conf_RK: np.ndarray, stale_RK: np.ndarray, sps: SPS) -> np.ndarray:
    """The asynchronous variant: capacity from the confidences two steps old, allocation by the current ones.

    stale_RK[r] is request r's conf_K of two engine steps earlier, or a row of NaN where it has none yet (its
    first two steps). If any row is missing, the step is Algorithm 1 with its early stop on the current
    confidences: the lossless fallback (module docstring); the current values never stand in for stale ones.
    """
    c_RK = _conf(conf_RK)
    s_RK = np.asarray(stale_RK, dtype=np.float64)
    if s_RK.shape != c_RK.shape:
        raise ValueError(f"stale confidences must have the current ones' shape {c_RK.shape}, got {s_RK.shape}")
    if np.isnan(s_RK).any(axis=1).any():
        return algorithm1(c_RK, sps)
    return async_allocate(c_RK, async_capacity(s_RK, sps))


def _draft_counts(drafts_R, R: int, K: int) -> np.ndarray:
    d_R = np.asarray(drafts_R)
    if (d_R.shape != (R,) or not np.issubdtype(d_R.dtype, np.integer) or d_R.min(initial=0) < 0
            or d_R.max(initial=0) > K):
        raise ValueError(f"drafts must be {R} integer counts in 0..{K}, got {d_R.tolist()}")
    return d_R.astype(np.int64)


def vllm_budget(stale_RK: np.ndarray, drafts_R: np.ndarray, non_draft_R: np.ndarray, sampling_R: np.ndarray,
                draft_ms_N: np.ndarray, verify_ms_N: np.ndarray, max_total_logits: int | None = None,
                num_bonus_tokens: int = 1) -> int:
    """vLLM's draft budget: how many draft tokens the step verifies (get_num_tokens; its arithmetic, in its order).

    stale_RK: the confidences vLLM's buffer holds for each scheduled request (float32 values); drafts_R: drafts
    scheduled per request (0 for a prefill); non_draft_R: its other scheduled tokens; sampling_R: whether it samples
    this step (a decode, or a prefill's last chunk); draft_ms_N, verify_ms_N: serving.sps.vllm_cost_tables.
    max_total_logits caps the budget at max_total_logits − R·num_bonus_tokens (vLLM: the rows of one
    rejection-sampling chunk, 2^30 bytes of fp32 logits; None: no cap).
    """
    s_RK = np.asarray(stale_RK, dtype=np.float64)
    if s_RK.ndim != 2 or s_RK.shape[0] == 0:
        raise ValueError(f"stale confidences must be [R requests, K positions] with R >= 1, got shape {s_RK.shape}")
    if not np.all((s_RK >= 0) & (s_RK <= 1)):  # also rejects NaN: vLLM reads ones where a request has none yet
        raise ValueError("stale confidences must be probabilities in [0, 1] (ones where a request has none yet)")
    R, K = s_RK.shape
    d_R = _draft_counts(drafts_R, R, K)
    n_R, samp_R = np.asarray(non_draft_R, dtype=np.int64), np.asarray(sampling_R, dtype=bool)
    if n_R.shape != (R,) or samp_R.shape != (R,):
        raise ValueError(f"non_draft_R and sampling_R need one entry per request ({R})")
    valid_RK = np.arange(K)[None, :] < d_R[:, None]
    scores_M = np.sort(np.cumprod(s_RK, axis=1)[valid_RK])[::-1]
    N = int(n_R.sum())
    cap = int(d_R.sum())
    if max_total_logits is not None:
        cap = min(cap, max(0, max_total_logits - R * num_bonus_tokens))
    if R >= len(draft_ms_N) or N + cap >= len(verify_ms_N):
        raise ValueError(f"cost tables too short: need draft_ms[{R}] and verify_ms[{N + cap}], have "
                         f"{len(draft_ms_N)} and {len(verify_ms_N)} entries")
    S = int(np.count_nonzero(samp_R))
    gain_B1 = np.concatenate(([S], S + np.cumsum(scores_M[:cap])))
    cost_B1 = draft_ms_N[R] + verify_ms_N[N:N + cap + 1]
    return int(np.argmax(gain_B1 / cost_B1))


def vllm_admit(conf_RK: np.ndarray, drafts_R: np.ndarray, budget: int) -> np.ndarray:
    """vLLM's admission: ℓ_R from the `budget` best current slots (_assign_draft_token_budget; every scheduled
    draft when the budget covers them, as reallocate_drafts does). Survival as vLLM computes it on CPU: the
    confidences in float32, their running product accumulated in float64 (torch's CPU cumprod) and stored as
    float32. Exact ties are taken by position, then request (vLLM's torch.topk: unspecified, module docstring)."""
    c_RK = _conf(conf_RK).astype(np.float32)
    R, K = c_RK.shape
    d_R = _draft_counts(drafts_R, R, K)
    if not (isinstance(budget, int | np.integer) and 0 <= budget <= d_R.sum()):
        raise ValueError(f"budget must be an integer in 0..{int(d_R.sum())} (the scheduled drafts), got {budget!r}")
    if budget == d_R.sum():
        return d_R
    a_RK = np.cumprod(c_RK.astype(np.float64), axis=1).astype(np.float32)
    a_RK[np.arange(K)[None, :] >= d_R[:, None]] = -np.inf  # slots without a draft never outrank a real one
    _, r_M, _ = _rank_survival(a_RK)
    return _lengths(r_M, int(budget), R)


def vllm_adaptive(conf_RK: np.ndarray, stale_RK: np.ndarray, draft_ms_N: np.ndarray,
                  verify_ms_N: np.ndarray) -> np.ndarray:
    """vLLM's adaptive verification of R decode requests with γ = K drafts each (one non-draft token each, all
    sampling): the budget from the stale confidences, admission by the current ones."""
    c_RK = _conf(conf_RK)
    s_RK = np.asarray(stale_RK, dtype=np.float64)
    if s_RK.shape != c_RK.shape:
        raise ValueError(f"stale confidences must have the current ones' shape {c_RK.shape}, got {s_RK.shape}")
    R, K = c_RK.shape
    drafts_R = np.full(R, K, dtype=np.int64)
    budget = vllm_budget(s_RK, drafts_R, np.ones(R, dtype=np.int64), np.ones(R, dtype=bool), draft_ms_N,
                         verify_ms_N)
    return vllm_admit(c_RK, drafts_R, budget)
