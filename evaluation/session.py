"""The target side of offline speculative decoding: one sequence's KV cache and features, and `generate`.

One round (fixed block, chain drafting, no confidence scheduler): the last emitted token is the anchor x_0 at
position p, which the target has not run yet; the drafter proposes x_1..x_γ; one target forward over
[x_0, x_1..x_γ] gives the γ+1 distributions for positions p+1..p+γ+1; `draft_model.sampling` accepts a prefix
of n drafts and draws one more token (replacement or bonus). τ = n + 1 tokens are emitted; the KV cache is
cropped back to positions 0..p+n (what the target saw of the accepted prefix) and the new anchor is the extra
token. The same forwards provide the context features a DSpark/DFlash drafter reads: hidden states of the
configured target layers at every verified position, cached and appended as the prefix grows.

Legend (shape suffixes):  L verified prefix positions   K block size γ   V vocabulary
                          D target hidden size           F context feature width = len(layers) x D
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from draft_model import sampling
from evaluation.drafters import DecodeContext, Drafter
from workers.frozen_target.model import FINAL_HIDDEN, layer_features, lm_head_input, target_dims, validate_layers

__all__ = ["RoundLog", "TargetSession", "generate"]


# ---- the target side: one sequence, KV cache, feature capture ---------------------------------------------------


class TargetSession:
    """One sequence on the target: its KV cache, the verified tokens and the captured features per position.

    Invariant between rounds: the cache holds positions 0..p-1, `ids` holds positions 0..p (the last one is the
    anchor), features are stored for 0..p-1.
    """

    def __init__(self, model: nn.Module, layers: list[int], prompt_ids: list[int], max_len: int) -> None:
        from transformers import DynamicCache

        if not prompt_ids:
            raise ValueError("a prompt must have at least one token")
        if layers:
            validate_layers(layers, target_dims(model)[2])
        self.model, self.layers = model, list(layers)
        self.device = model.get_output_embeddings().weight.device
        self.cache = DynamicCache(config=model.config)
        self.ids = list(prompt_ids)
        D = target_dims(model)[1]
        dtype = model.get_output_embeddings().weight.dtype
        # preallocated so that handing the prefix to the drafter every round is a view, not a concatenation
        self._feats_LF = torch.zeros(max_len, len(self.layers) * D, dtype=dtype, device=self.device)
        self._num_feats = 0
        self.forwards = 0
        self._pending_feats: torch.Tensor | None = None
        if len(self.ids) > 1:  # prefill everything but the anchor
            _, feats = self._forward(self.ids[:-1], last_only=True)
            self._append(feats)

    @property
    def anchor(self) -> int:
        return self.ids[-1]

    def context(self) -> DecodeContext:
        n = self._num_feats
        return DecodeContext(torch.tensor(self.ids[:n], dtype=torch.long, device=self.device), self._feats_LF[:n])

    def _append(self, feats_LF: torch.Tensor) -> None:
        n, m = self._num_feats, feats_LF.shape[0]
        if n + m > self._feats_LF.shape[0]:
            raise ValueError(f"sequence longer than max_len={self._feats_LF.shape[0]}")
        self._feats_LF[n: n + m] = feats_LF
        self._num_feats += m

    @torch.no_grad()
    def _forward(self, ids: list[int], last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `ids` after the cached prefix -> (logits [L or 1, V] fp32, feats_LF). In a prefill (`last_only`)
        only the last row needs logits."""
        want_hs = any(i != FINAL_HIDDEN for i in self.layers)
        with lm_head_input(self.model, last_only) as captured:
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                             cache=self.cache, use_cache=True, output_hidden_states=want_hs,
                             return_dict=True)
        self.forwards += 1
        final_1LD = captured["final"]
        assert final_1LD.shape[1] == len(ids), "the LM-head input is not per token"
        return out.logits[0].float(), layer_features(final_1LD, out.hidden_states, self.layers)[0]

    def verify_forward(self, draft_tokens_K: torch.Tensor) -> torch.Tensor:
        """Target forward over [anchor, x_1..x_K] -> logits [K+1, V] for positions p+1..p+K+1."""
        logits_K1V, self._pending_feats = self._forward([self.anchor] + draft_tokens_K.tolist(), last_only=False)
        return logits_K1V

    def verify(self, draft_tokens_K: torch.Tensor, draft_probs_KV: torch.Tensor, temperature: float,
               generator: torch.Generator) -> sampling.VerifyResult:
        """One verification round: the target's forward over [anchor, x_1..x_K], accept a prefix of the drafts
        and draw one more token (draft_model.sampling; greedy at T = 0), and commit what was emitted. K = 0 is
        allowed: no draft, the target samples the next token at the anchor alone."""
        logits_K1V = self.verify_forward(draft_tokens_K)
        if logits_K1V.shape[-1] != draft_probs_KV.shape[-1]:
            raise ValueError(f"drafter vocab {draft_probs_KV.shape[-1]} != target vocab {logits_K1V.shape[-1]}")
        if temperature == 0:
            res = sampling.verify_greedy(draft_tokens_K, logits_K1V)
        else:
            q_K1V = sampling.probs_at_temperature(logits_K1V, temperature)
            res = sampling.verify_block(draft_tokens_K, draft_probs_KV.to(q_K1V), q_K1V, generator)
        emitted = res.token_list()
        self.commit(emitted[:-1], emitted[-1])
        return res

    def commit(self, accepted_tokens: list[int], next_token: int) -> None:
        """Keep anchor + accepted drafts (positions p..p+n), drop the rest from the cache; next_token is the anchor."""
        assert self._pending_feats is not None, "commit() without a verify_forward()"
        n = len(accepted_tokens)
        drop = self.cache.get_seq_length() - (self._num_feats + 1 + n)  # keep positions 0..p+n
        if drop > 0:  # transformers 5 crops by a negative count of tokens to remove
            self.cache.crop(-drop)
        self._append(self._pending_feats[: n + 1])
        self._pending_feats = None
        self.ids += list(accepted_tokens) + [next_token]
        assert self.cache.get_seq_length() == self._num_feats == len(self.ids) - 1


@dataclass
class RoundLog:
    """Per-round records of one dataset, the raw material of its metrics and of rounds.parquet (evaluation/rounds.py).

    Rounds are verified at full γ today, so `num_accepted` is exactly "accepted had all γ been verified", the n a
    replay under any verification policy needs (serving/simulator.py).
    """

    accepted_RK: list[torch.Tensor] = field(default_factory=list)  # int8 [K] VerifyResult.accepted_K codes
    conf_RK: list[torch.Tensor] = field(default_factory=list)  # float [K] confidences as reported (or empty)
    conf_logit_RK: list[torch.Tensor] = field(default_factory=list)  # float [K] raw logits behind them (or empty)
    num_accepted_R: list[int] = field(default_factory=list)  # n: accepted draft tokens of the round
    verified_R: list[int] = field(default_factory=list)  # draft tokens the target verified (γ: no scheduler yet)
    draft_s_R: list[float] = field(default_factory=list)  # wall time of the drafter's propose() (synchronised)
    prompt_R: list[int] = field(default_factory=list)  # index of the prompt (one replay stream per prompt)


def sync(device: torch.device) -> None:
    """Wait for queued kernels, so that a wall-clock reading counts them (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(target: nn.Module, drafter: Drafter, prompt_ids: list[int], temperature: float, max_new_tokens: int,
             generator: torch.Generator, eos_ids: set[int] | frozenset[int] = frozenset(),
             rounds: RoundLog | None = None, prompt_index: int = 0) -> tuple[list[int], int]:
    """Speculative decoding of one prompt -> (new tokens, target forwards). Round records go to `rounds`, tagged
    with `prompt_index`."""
    session = TargetSession(target, drafter.target_layers, prompt_ids,
                            max_len=len(prompt_ids) + max_new_tokens + drafter.block_size + 1)
    new: list[int] = []
    while len(new) < max_new_tokens:
        sync(session.device)
        t0 = time.perf_counter()
        prop = drafter.propose(session.context(), session.anchor, temperature, generator)
        sync(session.device)
        draft_s = time.perf_counter() - t0
        tokens_K, conf_K = prop.tokens_K, prop.conf_K
        res = session.verify(tokens_K, prop.probs_KV, temperature, generator)
        emitted = res.token_list()
        if rounds is not None:
            rounds.accepted_RK.append(res.accepted_K.cpu())
            if conf_K is not None:
                rounds.conf_RK.append(conf_K.float().cpu())
            if prop.conf_logit_K is not None:
                rounds.conf_logit_RK.append(prop.conf_logit_K.float().cpu())
            rounds.num_accepted_R.append(int(res.num_accepted))
            rounds.verified_R.append(int(tokens_K.shape[0]))
            rounds.draft_s_R.append(draft_s)
            rounds.prompt_R.append(prompt_index)
        for t in emitted:
            new.append(t)
            if t in eos_ids or len(new) >= max_new_tokens:
                return new, session.forwards
    return new, session.forwards
