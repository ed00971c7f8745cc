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
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["algorithm1", "async_allocate", "async_capacity", "asynchronous", "rank_slots", "static_gamma",
           "theta_curve", "threshold"]

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
    c_RK = _conf(conf_RK)
    R, K = c_RK.shape
    a_RK = np.cumprod(c_RK, axis=1)
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
