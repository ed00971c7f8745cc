"""The Drafter contract of the evaluator and its adapters for the draft_model architectures.

A Drafter reads a DecodeContext (the verified prefix before the anchor and the target's features there) and
proposes γ tokens with the distributions they were drawn from, and its confidences when it has a head for them.

Legend (shape suffixes):  L verified prefix positions   K block size γ   V vocabulary   F context feature width
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from draft_model import sampling
from draft_model.batch import BlockBatch

__all__ = ["DecodeContext", "Drafter", "DSparkDrafter", "Eagle3Drafter", "make_drafter"]


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
