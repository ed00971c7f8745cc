"""Offline speculative-decoding evaluator: real decoding with a target (HF causal LM, KV cache) and a drafter.

One round (fixed block, chain drafting, no confidence scheduler): the last emitted token is the anchor x_0 at
position p, which the target has not run yet; the drafter proposes x_1..x_γ; one target forward over
[x_0, x_1..x_γ] gives the γ+1 distributions for positions p+1..p+γ+1; `draft_model.sampling` accepts a prefix
of n drafts and draws one more token (replacement or bonus). τ = n + 1 tokens are emitted; the KV cache is
cropped back to positions 0..p+n (what the target saw of the accepted prefix) and the new anchor is the extra
token. The same forwards provide the context features a DSpark/DFlash drafter reads: hidden states of the
configured target layers at every verified position, cached and appended as the prefix grows.

Metrics per dataset: mean τ, per-position conditional acceptance (denominator = rounds in which positions
1..k−1 were all accepted), target forwards (prefills + rounds), wall time, tokens/s, and — when the drafter
reports confidences — ECE and ROC-AUC of c_k against acceptance at every reached position. τ is counted from
the verifier's outcome of every round, also the last one whose tokens may be cut at max_new_tokens/EOS.

Legend (shape suffixes):  L verified prefix positions   K block size γ   V vocabulary
                          D target hidden size           F context feature width = len(layers) x D
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from draft_model import sampling
from draft_model.batch import BlockBatch
from draft_model.sampling import ACCEPTED, NOT_REACHED
from evaluation.report import expected_calibration_error, roc_auc
from pipeline.target_model import FINAL_HIDDEN, target_dims, validate_layers

__all__ = ["DecodeContext", "Drafter", "DSparkDrafter", "Eagle3Drafter", "make_drafter", "RoundLog", "TargetSession",
           "encode_prompt", "evaluate", "evaluate_many", "generate"]


@dataclass
class DecodeContext:
    """What a drafter may read: the verified prefix before the anchor and the target's features there."""

    ids_L: torch.Tensor  # int64 [L] verified tokens at positions 0..p-1 (the anchor, at p, is passed separately)
    feats_LF: torch.Tensor  # [L, F] target hidden states at those positions for Drafter.target_layers ([L, 0]
    #                         when the drafter asked for none)


class Drafter(Protocol):
    name: str
    block_size: int  # γ drafted tokens per round
    target_layers: list[int]  # target hidden states wanted in DecodeContext.feats_LF (-1 = LM-head input)

    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (tokens_K int64, probs_KV: the distributions the tokens were drawn from at `temperature` (one-hot
        when greedy), conf_K: conditional confidences c_k in [0, 1] or None)."""
        ...


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
        """Run `ids` after the cached prefix -> (logits [L or 1, V] fp32, feats_LF)."""
        captured: dict[str, torch.Tensor] = {}

        def grab_lm_head_input(module: nn.Module, args: tuple):
            # the exact LM-head input, for any architecture; in a prefill only the last row needs logits
            captured["final"] = args[0]
            return ((args[0][:, -1:],) + tuple(args[1:])) if last_only else None

        want_hs = any(i != FINAL_HIDDEN for i in self.layers)
        handle = self.model.get_output_embeddings().register_forward_pre_hook(grab_lm_head_input)
        try:
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long, device=self.device),
                             cache=self.cache, use_cache=True, output_hidden_states=want_hs,
                             return_dict=True)
        finally:
            handle.remove()
        self.forwards += 1
        final_LD = captured["final"][0]
        assert final_LD.shape[0] == len(ids), "the LM-head input is not per token"
        parts = [final_LD if i == FINAL_HIDDEN else out.hidden_states[i][0].to(final_LD.device) for i in self.layers]
        feats_LF = torch.cat(parts, dim=-1) if parts else final_LD.new_zeros(len(ids), 0)
        return out.logits[0].float(), feats_LF

    def verify_forward(self, draft_tokens_K: torch.Tensor) -> torch.Tensor:
        """Target forward over [anchor, x_1..x_K] -> logits [K+1, V] for positions p+1..p+K+1."""
        logits_K1V, self._pending_feats = self._forward([self.anchor] + draft_tokens_K.tolist(), last_only=False)
        return logits_K1V

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


# ---- the DSpark / DFlash drafter -----------------------------------------------------------------------------


class DSparkDrafter:
    """A `draft_model.model.DraftModel` as a Drafter: one block at the anchor of a single sequence."""

    def __init__(self, model: nn.Module, name: str = "dspark") -> None:
        self.model = model.eval()
        self.name = name
        self.block_size = model.cfg.block_size
        self.target_layers = list(model.cfg.target_layers)

    def block_batch(self, ctx: DecodeContext, anchor_token: int, start: int = 0) -> BlockBatch:
        """A one-sequence, one-block BlockBatch for the block at the anchor, with context rows start..p-1."""
        feats_LF = ctx.feats_LF[start:]
        T = feats_LF.shape[0] + 1
        dev = feats_LF.device
        return BlockBatch(
            input_ids_T=torch.cat([ctx.ids_L[start:], torch.tensor([anchor_token], device=dev)]),
            # the anchor's own row is never read: a block sees context strictly before its anchor
            ctx_feats_TF=torch.cat([feats_LF, feats_LF.new_zeros(1, feats_LF.shape[1])]),
            final_hidden_TD=feats_LF.new_zeros(1, self.model.cfg.hidden_size).expand(T, -1),  # training-only
            seq_start_S1=torch.tensor([0, T], device=dev),
            block_seq_N=torch.zeros(1, dtype=torch.long, device=dev),
            anchor_pos_N=torch.tensor([T - 1], device=dev),
            valid_NK=torch.ones(1, self.block_size, dtype=torch.bool, device=dev),
        )

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        m = self.model
        window, p = m.cfg.sliding_window, ctx.ids_L.shape[0]
        # with a sliding window only the last `window` context tokens are visible: hand over just those; shifting
        # every position by the same amount leaves RoPE attention unchanged (it depends on differences only)
        batch = self.block_batch(ctx, anchor_token, start=max(0, p - window) if window > 0 else 0)
        lm_VD = m.lm_head_weight()
        hidden_KD = m.backbone_hidden(batch)[0]
        base_KV = hidden_KD.to(lm_VD.dtype) @ lm_VD.t()
        embeds: list[torch.Tensor] = []
        step_fn = None
        if m.head is not None:
            w2_RV = m.head_w2()
            state = None

            def step_fn(k: int, prev_B: torch.Tensor) -> torch.Tensor:
                nonlocal state
                factor_BR, prev_embed_BR, state = m.head.step(hidden_KD[k][None], prev_B, state)
                embeds.append(prev_embed_BR[0])
                return (factor_BR @ w2_RV).to(base_KV.dtype)

        tokens_K, probs_KV = sampling.sample_block(base_KV, step_fn, anchor_token, temperature, generator)
        conf_K = None
        if m.conf_proj is not None:
            prev_embed_KR = torch.stack(embeds) if embeds else None
            conf_K = torch.sigmoid(m.confidence_logit(hidden_KD, prev_embed_KR).float())
        return tokens_K, probs_KV, conf_K


class Eagle3Drafter(DSparkDrafter):
    """An `draft_model.eagle3.Eagle3Draft` as a Drafter: chain drafting over the same one-block batch."""

    @torch.no_grad()
    def propose(self, ctx: DecodeContext, anchor_token: int, temperature: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        window, p = self.model.cfg.sliding_window, ctx.ids_L.shape[0]
        batch = self.block_batch(ctx, anchor_token, start=max(0, p - window) if window > 0 else 0)
        out = self.model.draft_steps(batch, temperature, generator)
        return out.tokens_NK[0], out.probs_NKV[0], None if out.conf_NK is None else out.conf_NK[0]


def make_drafter(model: nn.Module, name: str | None = None) -> Drafter:
    """The Drafter for a trained draft of any registered architecture."""
    name = name or model.cfg.arch
    return Eagle3Drafter(model, name) if hasattr(model, "draft_steps") else DSparkDrafter(model, name)


# ---- decoding and metrics ----------------------------------------------------------------------------------


def encode_prompt(tokenizer, prompt: str | list[dict] | list[int]) -> list[int]:
    """Token ids of a prompt: raw text, a chat (rendered with the generation prompt) or ids as they are."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("a prompt must be a string, a non-empty list of chat messages or of token ids; "
                     f"got {prompt!r:.80}")


def _eos_ids(model: nn.Module, tokenizer, eos_token_ids: Iterable[int] | None) -> set[int]:
    if eos_token_ids is not None:
        return set(eos_token_ids)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))


@dataclass
class RoundLog:
    """Per-round records of one dataset, the raw material of its metrics."""

    accepted_RK: list[torch.Tensor]  # int8 [K] codes from VerifyResult.accepted_K, one per round
    conf_RK: list[torch.Tensor]  # float [K] drafter confidences c_k, one per round (empty without them)


def generate(target: nn.Module, drafter: Drafter, prompt_ids: list[int], temperature: float, max_new_tokens: int,
             generator: torch.Generator, eos_ids: set[int] | frozenset[int] = frozenset(),
             rounds: RoundLog | None = None) -> tuple[list[int], int]:
    """Speculative decoding of one prompt -> (new tokens, target forwards). Round records go to `rounds`."""
    session = TargetSession(target, drafter.target_layers, prompt_ids,
                            max_len=len(prompt_ids) + max_new_tokens + drafter.block_size + 1)
    new: list[int] = []
    while len(new) < max_new_tokens:
        tokens_K, probs_KV, conf_K = drafter.propose(session.context(), session.anchor, temperature, generator)
        logits_K1V = session.verify_forward(tokens_K)
        if logits_K1V.shape[-1] != probs_KV.shape[-1]:
            raise ValueError(f"drafter vocab {probs_KV.shape[-1]} != target vocab {logits_K1V.shape[-1]}")
        if temperature == 0:
            res = sampling.verify_greedy(tokens_K, logits_K1V)
        else:
            q_K1V = sampling.probs_at_temperature(logits_K1V, temperature)
            res = sampling.verify_block(tokens_K, probs_KV.to(q_K1V), q_K1V, generator)
        emitted = res.token_list()
        session.commit(emitted[:-1], emitted[-1])
        if rounds is not None:
            rounds.accepted_RK.append(res.accepted_K.cpu())
            if conf_K is not None:
                rounds.conf_RK.append(conf_K.float().cpu())
        for t in emitted:
            new.append(t)
            if t in eos_ids or len(new) >= max_new_tokens:
                return new, session.forwards
    return new, session.forwards


def _dataset_metrics(rounds: RoundLog, new_tokens: int, forwards: int, wall_s: float, num_prompts: int) -> dict:
    acc_RK = torch.stack(rounds.accepted_RK).long() if rounds.accepted_RK else torch.zeros(0, 0, dtype=torch.long)
    R = acc_RK.shape[0]
    tau_R = (acc_RK == ACCEPTED).sum(1).double() + 1
    reached_K = (acc_RK != NOT_REACHED).sum(0)
    accepted_K = (acc_RK == ACCEPTED).sum(0)
    cond = [None if int(r) == 0 else float(a) / float(r) for a, r in zip(accepted_K, reached_K)]
    ece = auc = None
    conf_mean: list[float | None] = []
    if rounds.conf_RK:
        assert len(rounds.conf_RK) == R, "a drafter must give confidences in every round or in none"
        conf_RK = torch.stack(rounds.conf_RK)
        reached = acc_RK != NOT_REACHED
        c, y = conf_RK[reached].numpy(), (acc_RK[reached] == ACCEPTED).numpy()
        ece, auc = expected_calibration_error(c, y, num_bins=10), roc_auc(c, y)
        conf_mean = [float(conf_RK[reached[:, k], k].mean()) if reached[:, k].any() else None
                     for k in range(conf_RK.shape[1])]
    return {
        "num_prompts": num_prompts,
        "rounds": R,
        "new_tokens": new_tokens,
        "tau": float(tau_R.mean()) if R else math.nan,
        "tau_sem": float(tau_R.std() / math.sqrt(R)) if R > 1 else math.nan,
        "cond_acceptance": cond,
        "reached": reached_K.tolist(),
        "target_forwards": forwards,
        "tokens_per_forward": new_tokens / forwards if forwards else math.nan,
        "wall_s": wall_s,
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else math.nan,
        "ece": ece,
        "roc_auc": auc,
        "conf_mean": conf_mean,
    }


def evaluate(target: nn.Module, tokenizer, drafter: Drafter, prompts: dict[str, list], temperature: float,
             max_new_tokens: int, seed: int = 0, eos_token_ids: Iterable[int] | None = None) -> dict:
    """Speculative decoding of every prompt of every dataset; returns the metrics (see the module docstring).

    prompts: dataset name -> prompts (text, chat messages or token ids). Each prompt gets its own generator
    seeded from (seed, dataset, index), so results do not depend on dataset order. eos_token_ids: None = the
    target's generation config / tokenizer; an empty list disables stopping at EOS.
    """
    return evaluate_many(target, tokenizer, [drafter], prompts, temperature, max_new_tokens, seed, eos_token_ids)[0]


def evaluate_many(target: nn.Module, tokenizer, drafters: list[Drafter], prompts: dict[str, list],
                  temperature: float, max_new_tokens: int, seed: int = 0,
                  eos_token_ids: Iterable[int] | None = None, deadline_s: float | None = None) -> list[dict]:
    """`evaluate` for several drafters on the same prompts, one result per drafter.

    Prompt i of every dataset runs for every drafter before prompt i + 1 of any, each with the same seed, so a
    time limit (`deadline_s`, a time.monotonic() value: no prompt index is started after it) leaves every drafter
    with the same prompts, as many from each dataset. Each result's num_prompts says how many ran.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos_ids = _eos_ids(target, tokenizer, eos_token_ids)
    device = target.get_output_embeddings().weight.device
    outs = [{"drafter": d.name, "gamma": d.block_size, "temperature": temperature, "max_new_tokens": max_new_tokens,
             "seed": seed, "datasets": {}, "generations": {}} for d in drafters]
    state = {(j, ds): {"rounds": RoundLog([], []), "gens": [], "forwards": 0, "new": 0, "wall": 0.0}
             for j in range(len(drafters)) for ds in prompts}
    for i in range(max((len(v) for v in prompts.values()), default=0)):
        if deadline_s is not None and time.monotonic() >= deadline_s:
            break
        for ds, items in prompts.items():
            if i >= len(items):
                continue
            ids = encode_prompt(tokenizer, items[i])
            entropy = [seed, zlib.crc32(ds.encode()), i]
            prompt_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
            for j, drafter in enumerate(drafters):
                st = state[(j, ds)]
                g = torch.Generator(device=device).manual_seed(prompt_seed)
                _sync(device)
                t0 = time.perf_counter()
                new, fwd = generate(target, drafter, ids, temperature, max_new_tokens, g, eos_ids, st["rounds"])
                _sync(device)
                st["wall"] += time.perf_counter() - t0
                st["forwards"] += fwd
                st["new"] += len(new)
                st["gens"].append({"prompt_tokens": len(ids), "tokens": new})
    for j, out in enumerate(outs):
        for ds in prompts:
            st = state[(j, ds)]
            for gen in st["gens"]:
                gen["text"] = tokenizer.decode(gen["tokens"]) if tokenizer is not None else None
            out["datasets"][ds] = _dataset_metrics(st["rounds"], st["new"], st["forwards"], st["wall"],
                                                   len(st["gens"]))
            out["generations"][ds] = st["gens"]
    return outs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
