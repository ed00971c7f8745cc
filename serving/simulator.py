"""Replay of recorded speculative-decoding rounds under a verification policy (DESIGN.md §3 "Replay semantics").

Legend (shape suffixes):  R  concurrent requests (engine slots)   K  draft positions γ of the recorded rounds

A RecordedRound keeps the calibrated conditional confidences c_1..c_K of one real round and n, the number of
draft tokens that would be accepted if all K were verified. Acceptance of slot k depends only on the prefix, so
verifying ℓ ≤ K tokens of that round emits exactly min(n, ℓ) + 1 tokens: rounds can be replayed under any policy
without re-running the target. Losslessness is a separate question (tests/test_serving_policies.py).

ASSUMPTION: replay keeps the recorded sequence of rounds, whereas a shorter verification would change the
contexts (and so the statistics) of later rounds. The simulator assumes round statistics do not depend on the
policy; check that once against real decoding driven by the policy before trusting small differences.

The engine: R requests are active at once. Slot r replays one stream (the rounds of one prompt, in order); when
a stream ends its request is finished and the next stream takes the slot (slot r starts with stream r mod S;
streams are cycled, so a sweep can run longer than the recording, and with R > S streams one stream is replayed
in several slots at once). Each engine step the policy chooses ℓ_R; the step emits min(n_r, ℓ_r) + 1 tokens for
request r and takes 1/SPS(B) seconds with B = Σ_r (ℓ_r + 1), plus draft_time_s(positions drafted): all K for the
confidence policies (the confidences come from drafting every position), γ for a static-γ drafter.
The policies plan with that same whole step: they are given engine_sps(B) = 1 / (1/SPS(B) + draft time), the
curve a serving engine measures when a step drafts and verifies (DESIGN.md's SPS(B) is the engine's). Planning
with the target's curve alone undervalues each verified token whenever drafting takes a fixed share of the step
(on the 2-core CPU a 1-layer draft costs about half a B = 1 target step).

Staleness of the asynchronous policy: its "stale" input for slot r is the confidences the slot had two engine
steps earlier (even when a new request has since taken the slot: the engine's double buffer is per slot). In
the first two steps there is nothing older: the stale input is NaN there, and the policy falls back to Algorithm 1
with its early stop (serving.policies.asynchronous; the current confidences must never stand in for stale ones).
vLLM's adaptive verification (`vllm_policy`, docs/vllm-scheduler.md) reads another "stale": its budget uses the
request's previous round (the confidences recorded two engine steps before, at the step that drafted the round
verified one step before), and ones in a request's first round (vLLM resets the row when a request is added).
Policy.stale names which of the two a policy is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from serving import policies as pol
from serving.sps import SPSTable, vllm_cost_curves, vllm_cost_tables

__all__ = ["STALE", "Policy", "RecordedRound", "SimResult", "algorithm1_policy", "async_policy", "pareto_plot",
           "simulate", "static_policy", "sweep", "threshold_policy", "verify_len_plot", "vllm_policy"]

# what a policy's stale input is: "two_steps" the slot's confidences two engine steps earlier (NaN before there are
# any); "previous_round" the request's previous round (ones in its first round), vLLM's double buffer;
# "previous_round_or_none" the previous round, NaN in a request's first (so serving.policies.asynchronous falls back)
STALE = ("two_steps", "previous_round", "previous_round_or_none")


@dataclass(frozen=True)
class RecordedRound:
    conf: tuple[float, ...]  # calibrated conditional confidences c_1..c_K
    num_accepted: int  # n: draft tokens accepted had all K been verified

    def __post_init__(self):
        if not all(0.0 <= c <= 1.0 for c in self.conf) or not self.conf:
            raise ValueError(f"RecordedRound.conf must be non-empty probabilities in [0, 1], got {self.conf}")
        if not 0 <= self.num_accepted <= len(self.conf):
            raise ValueError(f"RecordedRound.num_accepted must be in 0..{len(self.conf)}, got {self.num_accepted}")


@dataclass(frozen=True)
class Policy:
    name: str
    # (conf_RK, stale_conf_RK, sps) -> ell_R; stale rows are NaN where a request has no confidences two steps
    # old yet; sps(B) is the engine's whole step rate (simulate: engine_sps)
    choose: Callable[[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]], np.ndarray]
    draft_positions: int | None = None  # positions drafted per round; None = all K
    stale: str = "two_steps"  # one of STALE

    def __post_init__(self):
        if self.stale not in STALE:
            raise ValueError(f"Policy.stale must be one of {list(STALE)}, got {self.stale!r}")


def static_policy(gamma: int, name: str | None = None) -> Policy:
    """Fixed γ (a DFlash/Eagle3/DSpark baseline; γ = 1 is MTP-1); drafts only γ positions."""
    return Policy(name or f"static γ={gamma}", lambda c, s, sps: pol.static_gamma(c, gamma), gamma)


def threshold_policy(tau: float) -> Policy:
    return Policy(f"threshold τ={tau:g}", lambda c, s, sps: pol.threshold(c, tau))


def algorithm1_policy() -> Policy:
    return Policy("Algorithm 1", lambda c, s, sps: pol.algorithm1(c, sps))


def async_policy() -> Policy:
    """Capacity from the stale confidences, allocation by the current ones (the production variant); Algorithm 1
    with its early stop in the first two steps, where no stale confidences exist."""
    return Policy("async", pol.asynchronous)


def vllm_policy(sps: SPSTable, draft_s: float, cudagraph_limit: int | None = None) -> Policy:
    """vLLM 0.32.0's adaptive verification (serving.policies.vllm_adaptive) planning with vLLM's cost tables of
    `sps` and a draft time of `draft_s` seconds per step (pass the table and draft time the simulation charges),
    on vLLM's stale confidences (the previous round). cudagraph_limit: vLLM's largest captured size; None = the
    table's largest measured size (every measured size a captured bucket: the table's "step" lookup)."""
    draft_curve, verify_curve = vllm_cost_curves(sps, draft_s)
    limit = int(sps.batch_sizes[-1]) if cudagraph_limit is None else cudagraph_limit
    tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    def choose(conf_RK: np.ndarray, stale_RK: np.ndarray, _engine_sps) -> np.ndarray:
        R, K = conf_RK.shape
        if (R, K) not in tables:  # a table entry depends only on its own size, so any long-enough table will do
            tables[R, K] = vllm_cost_tables(draft_curve, verify_curve, R, R * (K + 1), limit)
        return pol.vllm_adaptive(conf_RK, stale_RK, *tables[R, K])

    return Policy("vLLM adaptive", choose, stale="previous_round")


@dataclass(frozen=True)
class SimResult:
    policy: str
    concurrency: int
    steps: int
    time_s: float
    tokens: int
    request_rounds: int  # Σ over steps of active requests (= steps · R)
    finished_requests: int
    tokens_per_s: float  # aggregate throughput
    per_user_tokens_per_s: float  # mean over requests of (its tokens / seconds it was active)
    mean_verify_len: float  # mean ℓ over request-rounds
    mean_batch_tokens: float  # mean B per step
    tau: float  # tokens per request-round

    def to_dict(self) -> dict:
        return asdict(self)


def _stream_arrays(streams: Sequence[Sequence[RecordedRound]]) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    if not streams or any(len(s) == 0 for s in streams):
        raise ValueError("simulate needs at least one stream, and every stream at least one recorded round")
    Ks = {len(rnd.conf) for s in streams for rnd in s}
    if len(Ks) != 1:
        raise ValueError(f"all recorded rounds must have the same number of draft positions, got {sorted(Ks)}")
    conf = [np.array([rnd.conf for rnd in s], dtype=np.float64) for s in streams]
    n = [np.array([rnd.num_accepted for rnd in s], dtype=np.int64) for s in streams]
    return conf, n, Ks.pop()


def engine_curve(sps: SPSTable, draft_s: float) -> Callable[[np.ndarray], np.ndarray]:
    """Steps per second of a whole engine step at B verified tokens: the target's 1/SPS(B) plus `draft_s` of
    drafting (vectorised over B, as the policies call it)."""
    if not draft_s >= 0:
        raise ValueError(f"draft time must be >= 0 seconds, got {draft_s!r}")
    return lambda B: 1.0 / (np.asarray(sps.step_time(B)) + draft_s)


def simulate(streams: Sequence[Sequence[RecordedRound]], policy: Policy, sps: SPSTable, concurrency: int,
             draft_time_s: Callable[[int], float], num_steps: int) -> SimResult:
    """Replay `num_steps` engine steps with `concurrency` requests active at once (see the module docstring)."""
    if concurrency < 1 or num_steps < 1:
        raise ValueError(f"need concurrency >= 1 and num_steps >= 1, got {concurrency} and {num_steps}")
    conf_streams, n_streams, K = _stream_arrays(streams)
    R, S = concurrency, len(conf_streams)
    drafted = K if policy.draft_positions is None else policy.draft_positions
    stream_R = np.arange(R) % S  # slot r starts with stream r (mod S)
    pos_R = np.zeros(R, dtype=np.int64)
    start_R = np.zeros(R)
    tok_R = np.zeros(R, dtype=np.int64)
    next_stream = R
    history: list[np.ndarray] = []  # conf_RK of the last two steps, oldest first
    previous_RK = np.full((R, K), np.nan)  # each request's previous round; NaN before its first
    draft_s = float(draft_time_s(drafted))  # the same every step: the policy drafts the same positions
    engine_sps = engine_curve(sps, draft_s)
    now, tokens, sum_ell, sum_B, finished = 0.0, 0, 0, 0, []
    for _ in range(num_steps):
        conf_RK = np.stack([conf_streams[s][p] for s, p in zip(stream_R, pos_R)])
        n_R = np.array([n_streams[s][p] for s, p in zip(stream_R, pos_R)])
        if policy.stale == "previous_round":
            stale_RK = np.nan_to_num(previous_RK, nan=1.0)  # vLLM's reset of a new request's row
        elif policy.stale == "previous_round_or_none":
            stale_RK = previous_RK
        else:
            stale_RK = history[0] if len(history) == 2 else np.full_like(conf_RK, np.nan)  # two steps old, or none
        ell_R = np.asarray(policy.choose(conf_RK, stale_RK, engine_sps))
        if ell_R.shape != (R,) or ell_R.min() < 0 or ell_R.max() > K:
            raise ValueError(f"policy {policy.name!r} returned {ell_R.tolist()}; need {R} lengths in 0..{K}")
        emitted_R = np.minimum(n_R, ell_R) + 1
        B = int((ell_R + 1).sum())
        now += float(sps.step_time(B)) + draft_s
        tokens += int(emitted_R.sum())
        sum_ell += int(ell_R.sum())
        sum_B += B
        tok_R += emitted_R
        history = (history + [conf_RK])[-2:]
        previous_RK = conf_RK.copy()
        pos_R += 1
        for r in np.flatnonzero(pos_R == np.array([len(n_streams[s]) for s in stream_R])):
            finished.append(tok_R[r] / (now - start_R[r]))  # the request is done: its own tokens per second
            previous_RK[r] = np.nan
            stream_R[r], pos_R[r], start_R[r], tok_R[r] = next_stream % S, 0, now, 0
            next_stream += 1
    # requests still running at the horizon count with the part of their life simulated so far
    running = [tok_R[r] / (now - start_R[r]) for r in range(R) if now > start_R[r]]
    per_user = finished + running
    return SimResult(policy=policy.name, concurrency=R, steps=num_steps, time_s=now, tokens=tokens,
                     request_rounds=num_steps * R, finished_requests=len(finished), tokens_per_s=tokens / now,
                     per_user_tokens_per_s=float(np.mean(per_user)) if per_user else math.nan,
                     mean_verify_len=sum_ell / (num_steps * R), mean_batch_tokens=sum_B / num_steps,
                     tau=tokens / (num_steps * R))


def sweep(streams: Sequence[Sequence[RecordedRound]], policies: Sequence[Policy], sps: SPSTable,
          concurrencies: Sequence[int], draft_time_s: Callable[[int], float], num_steps: int) -> list[SimResult]:
    """simulate() for every (policy, concurrency); results in that order."""
    return [simulate(streams, p, sps, c, draft_time_s, num_steps) for p in policies for c in concurrencies]


def by_policy(results: Sequence[SimResult]) -> dict[str, list[SimResult]]:
    groups: dict[str, list[SimResult]] = {}
    for r in results:
        groups.setdefault(r.policy, []).append(r)
    return {k: sorted(v, key=lambda r: r.concurrency) for k, v in groups.items()}


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def pareto_plot(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Aggregate tokens/s against per-user tokens/s, one line per policy, points labelled by concurrency."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for name, rs in by_policy(results).items():
        x, y = [r.per_user_tokens_per_s for r in rs], [r.tokens_per_s for r in rs]
        ax.plot(x, y, marker="o", ms=3, label=name)
        for r in rs:
            ax.annotate(str(r.concurrency), (r.per_user_tokens_per_s, r.tokens_per_s), fontsize=6)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(title or "throughput vs per-user speed (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def verify_len_plot(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Mean verification length ℓ against concurrency, one line per policy."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    for name, rs in by_policy(results).items():
        ax.plot([r.concurrency for r in rs], [r.mean_verify_len for r in rs], marker="o", ms=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency R")
    ax.set_ylabel("mean verified draft tokens ℓ")
    ax.set_title(title or "verification length vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
