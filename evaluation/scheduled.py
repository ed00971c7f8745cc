"""Policy-driven speculative decoding: R requests decoded in lock-step, sharing one verification budget.

This is the "target in the loop" counterpart of serving/simulator.py (DESIGN.md §3): the same serving Policy
(static γ, threshold, Algorithm 1, the asynchronous variant) chooses how many draft tokens of every request one
engine step verifies, but here the target really verifies them, so the emitted tokens can be checked against the
target's own distribution (tests/test_scheduled.py) and the replay assumption can be measured.

One engine step, for the R requests still running:
1. every request drafts its full block x_1..x_γ with its confidences c_1..c_γ (Proposal.conf_K, STS-calibrated
   when the drafter has calibration.json; a drafter without confidences reports none and gets c = 1, which only
   static γ can use meaningfully);
2. the policy picks ℓ_R jointly from conf_RK (and, for the asynchronous variant, the confidences each request
   had two steps earlier: a row of NaN in its first two steps, as in the simulator, where the policy falls back
   to Algorithm 1 with its early stop), and SPS(B);
3. request r verifies only x_1..x_{ℓ_r}: one target forward over [anchor, x_1..x_{ℓ_r}] and the rejection rule
   (TargetSession.verify, the round of evaluation/session.py) on that prefix, emitting n_r + 1 = min(n, ℓ_r) + 1
   tokens. With ℓ_r = 0 (an empty block, which sampling.verify_block takes) the rule reduces to "sample the next
   token from the target's distribution at the anchor" (its argmax, greedy).
Truncating a block to its first ℓ tokens is a valid draft of length ℓ: slot k's token and distribution depend
only on the slots before it. What the policy must not do is let x_{r,j} decide its own admission; Algorithm 1's
early stop and the asynchronous variant's stale capacity (or its early-stop fallback) ensure that
(serving/policies.py).

The target runs one forward per request per step (a TargetSession each), not one batched forward: this module
is about what is emitted, not how fast; cost comes from the SPS table in the simulator.

Legend (shape suffixes):  R  running requests   K  draft positions γ   V  vocabulary
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from evaluation.drafters import Drafter
from evaluation.session import TargetSession
from serving.simulator import Policy
from serving.sps import SPSTable

__all__ = ["ScheduledResult", "scheduled_generate", "verify_prefix"]


@dataclass
class ScheduledResult:
    tokens: list[list[int]]  # new tokens per request
    steps: int = 0  # engine steps (lock-step rounds) until every request finished
    request_steps: int = 0  # Σ over steps of running requests
    verified: list[int] = field(default_factory=list)  # ℓ of every (step, running request)
    emitted: list[int] = field(default_factory=list)  # tokens emitted by the same (step, request), before cutting

    @property
    def tau(self) -> float:
        """Tokens emitted per request-step (the simulator's SimResult.tau), counting every verifier outcome."""
        return sum(self.emitted) / self.request_steps if self.request_steps else float("nan")

    @property
    def mean_verify_len(self) -> float:
        return float(np.mean(self.verified)) if self.verified else float("nan")


def verify_prefix(session: TargetSession, tokens_K: torch.Tensor, probs_KV: torch.Tensor, ell: int,
                  temperature: float, generator: torch.Generator) -> list[int]:
    """Verify the first `ell` drafted tokens of one request on its target session and commit the result.

    Returns the emitted tokens (accepted drafts, then the replacement/bonus token): between 1 and ell + 1.
    """
    if not 0 <= ell <= tokens_K.shape[0]:
        raise ValueError(f"ell must be in 0..{tokens_K.shape[0]}, got {ell}")
    # ell = 0: no draft token, the rejection rule degenerates to sampling the target at the anchor
    return session.verify(tokens_K[:ell], probs_KV[:ell], temperature, generator).token_list()


def scheduled_generate(target: nn.Module, drafter: Drafter, prompts: Sequence[list[int]], policy: Policy,
                       sps: SPSTable, temperature: float, max_new_tokens: int, generator: torch.Generator,
                       eos_ids: set[int] | frozenset[int] = frozenset()) -> ScheduledResult:
    """Decode every prompt (R = len(prompts) requests at once) with `policy` choosing the verification lengths.

    A request stops at `max_new_tokens` or an EOS token and then leaves the batch; the others continue.
    """
    if not prompts:
        raise ValueError("need at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    K = drafter.block_size
    sessions = [TargetSession(target, drafter.target_layers, list(p), max_len=len(p) + max_new_tokens + K + 1)
                for p in prompts]
    out = ScheduledResult(tokens=[[] for _ in prompts])
    history: list[list[np.ndarray]] = [[] for _ in prompts]  # per request: its conf_K of the last two steps
    running = list(range(len(prompts)))
    while running:
        props = [drafter.propose(sessions[r].context(), sessions[r].anchor, temperature, generator) for r in running]
        conf_RK = np.stack([np.ones(K) if p.conf_K is None else p.conf_K.double().cpu().numpy() for p in props])
        conf_RK = np.clip(conf_RK, 0.0, 1.0)
        stale_RK = np.stack([history[r][0] if len(history[r]) == 2 else np.full(K, np.nan) for r in running])
        ell_R = np.asarray(policy.choose(conf_RK, stale_RK, sps))
        if ell_R.shape != (len(running),) or ell_R.min() < 0 or ell_R.max() > K:
            raise ValueError(f"policy {policy.name!r} returned {ell_R.tolist()}; need {len(running)} lengths in 0..{K}")
        still = []
        for i, r in enumerate(running):
            history[r] = (history[r] + [conf_RK[i]])[-2:]
            emitted = verify_prefix(sessions[r], props[i].tokens_K, props[i].probs_KV, int(ell_R[i]), temperature,
                                    generator)
            out.verified.append(int(ell_R[i]))
            out.emitted.append(len(emitted))
            done = False
            for t in emitted:
                out.tokens[r].append(t)
                if t in eos_ids or len(out.tokens[r]) >= max_new_tokens:
                    done = True
                    break
            if not done:
                still.append(r)
        out.steps += 1
        out.request_steps += len(running)
        running = still
    return out
