"""EAGLE-3 baseline drafter (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test"): one autoregressive decoder layer over fused low/middle/high target features,
trained with the training-time test unrolled over the γ slots of each block.

Notation: x_j is the token at position j, g_j = W_fuse [H(l_1)_j; ...; H(l_m)_j] the fused target feature there
(the target's state at j is what predicted x_{j+1}; with `draft.fuse_features: false` and one target layer,
g_j = H(l_1)_j, no W_fuse: the MTP-1 preset). The draft's input at position j is
    u_j = W_in [RMSNorm(embed(x_{j+1})); RMSNorm(f_j)]        (2D -> D)
with f_j = g_j for positions the target has run, and then one pre-norm decoder layer (causal self-attention with
RoPE over absolute positions, SwiGLU), a final norm, and the target's frozen LM head, which predicts x_{j+2}.

A block anchored at p (the target has run 0..p-1; x_p is the last sampled token; slot k predicts x_{p+k+1}):
- context keys: positions j <= p-2, inputs u_j built from target features (tokens up to x_{p-1});
- step 0, at position p-1: input [embed(x_p); g_{p-1}] -> predicts x_{p+1} (slot 0);
- step s >= 1, at position p-1+s: input [embed(x_{p+s}); a_{s-1}], where a_{s-1} is the draft's own pre-final-norm
  output of step s-1 (the training-time test: the draft learns from its own features, as at inference), and
  x_{p+s} is the ground-truth token while training (teacher forcing, as EAGLE-3 trains) or the token sampled at
  step s-1 in `draft_block`. Its query sees the context keys and the block's steps 0..s (causal).
Training and inference run the same `_step`, so they agree by construction (tests/test_eagle3.py checks it).

With γ = 1 and target_layers = [-1] (preset `mtp1`) only step 0 exists and this is DeepSeek-V3's MTP module run
causally over the sequence: u_j = W_in [norm(embed(x_{j+1})); norm(h_j)], one decoder layer, norm, frozen head,
predicting x_{j+2} (tests/test_mtp1.py recomputes it by hand; departures in docs/design-notes.md, "Baselines").

Departures from the paper, on purpose: the full target vocabulary and its frozen LM head (EAGLE-3 trains a reduced
draft vocabulary with its own head), so that the loss, the confidence head and the evaluator are shared with
DSpark/DFlash; a chain of γ tokens instead of a dynamic tree; the 2D input is projected to D before a standard
pre-norm layer (EAGLE-3 projects q/k/v from the 2D concat and keeps the feature as the residual). A block at p = 0
has no g_{-1}: its step 0 reads a zero feature. Gradients flow through the unrolled steps (no detach).

Legend: T tokens in the batch, N blocks, K block size γ, W context width, S steps so far, D hidden, F context
feature width (m target layers x D), V vocab, H query heads, G key/value heads, R = H/G, E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draft_model.attention import StepAttention, StepContext, token_positions_T
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig
from draft_model.ffn import SwiGLU
from draft_model.model import DraftOutput, FrozenTargetDraft, resolve_cfg
from draft_model.registry import register_draft
from draft_model.sampling import probs_at_temperature, sample_categorical


@dataclass
class _Context(StepContext):
    """Per-forward state shared by the γ steps: the gathered context keys/values (StepContext: positions <= p-2,
    inside the window) and where each block starts."""

    feat0_ND: torch.Tensor  # g_{p-1} (zero at p = 0): the feature of step 0
    pos0_N: torch.Tensor  # int64 position p-1 of step 0


@register_draft("eagle3")
class Eagle3Draft(FrozenTargetDraft):
    def __init__(self, cfg: DraftConfig, embed_weight_VD: torch.Tensor, lm_head_weight_VD: torch.Tensor) -> None:
        super().__init__(embed_weight_VD, lm_head_weight_VD)
        cfg = resolve_cfg(cfg, embed_weight_VD, lm_head_weight_VD)
        unsupported = {"num_layers": (cfg.num_layers, 1), "ffn": (cfg.ffn, "dense"),
                       "residual": (cfg.residual, "plain"), "head": (cfg.head, "none")}
        for name, (got, want) in unsupported.items():
            if got != want:
                # more layers would need a causal pass over every context position per layer; the sequential
                # heads and MoE/mHC belong to DSpark, and mixing them in would blur the baseline
                raise ValueError(f"eagle3 drafts need draft.{name}={want!r}, got {got!r}")
        self.cfg = cfg

        D = cfg.hidden_size
        self.ctx_width = len(cfg.target_layers) * D
        # fuse_features=False (MTP-1): the one target layer goes straight into feat_norm, as DeepSeek-V3's MTP does
        self.fuse = nn.Linear(self.ctx_width, D, bias=False) if cfg.fuse_features else None
        self.embed_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.feat_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)  # scale of g and of the draft's own a differ
        self.in_proj = nn.Linear(2 * D, D, bias=False)
        self.attn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.attn = StepAttention(cfg)
        self.ffn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.ffn = SwiGLU(D, cfg.resolved_intermediate_size)
        self.final_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.conf_proj = nn.Linear(D, 1) if cfg.confidence else None

    # ---- the unrolled layer -------------------------------------------------------------------------------

    def _input(self, tokens_L: torch.Tensor, feat_LD: torch.Tensor) -> torch.Tensor:
        e_LD = self.frozen_embed_VD[tokens_L].to(feat_LD.dtype)
        return self.in_proj(torch.cat([self.embed_norm(e_LD), self.feat_norm(feat_LD)], dim=-1))

    def _feedback(self, a_ND: torch.Tensor) -> torch.Tensor:
        """The feature the next step reads: the draft's own output (a seam for the unrolling test)."""
        return a_ND

    def _context(self, batch: BlockBatch) -> _Context:
        if batch.ctx_feats_TF.shape[1] != self.ctx_width:
            raise ValueError(f"BlockBatch.ctx_feats has width {batch.ctx_feats_TF.shape[1]}, but the draft expects "
                             f"{self.ctx_width} = {len(self.cfg.target_layers)} target layers x hidden "
                             f"{self.cfg.hidden_size}")
        if batch.block_size != self.cfg.block_size:
            raise ValueError(f"BlockBatch has block size {batch.block_size}, the draft was built for "
                             f"{self.cfg.block_size}")
        dtype = self.in_proj.weight.dtype
        ids_T = batch.input_ids_T
        T = ids_T.shape[0]
        g_TD = batch.ctx_feats_TF.to(dtype)
        g_TD = g_TD if self.fuse is None else self.fuse(g_TD)
        # context input of token t pairs g_t with the token after it; the last token of a sequence gets a
        # neighbour's (or its own) id, harmless because it is never a context key (keys stop at p-2 <= len-3)
        next_T = ids_T[torch.clamp(torch.arange(1, T + 1, device=ids_T.device), max=max(T - 1, 0))]
        k_TGE, v_TGE = self.attn.keys_values(self.attn_norm(self._input(next_T, g_TD)),
                                             token_positions_T(batch.seq_start_S1, T))
        p_N = batch.anchor_pos_N
        index_NW, pos_NW, valid_NW = batch.context_window(self.cfg.sliding_window)
        valid_NW = valid_NW & (pos_NW < (p_N - 1)[:, None])  # p-1 is step 0 itself, a query of the block
        prev_N = torch.clamp(batch.anchor_index_N() - 1, min=0)
        feat0_ND = torch.where((p_N > 0)[:, None], g_TD[prev_N], torch.zeros_like(g_TD[prev_N]))
        # contiguous [N, G, W, E] once, so the γ per-step matmuls do not each copy the gathered context
        return _Context(k_TGE[index_NW].transpose(1, 2).contiguous(), v_TGE[index_NW].transpose(1, 2).contiguous(),
                        valid_NW, feat0_ND, p_N - 1)

    def _step(self, ctx: _Context, s: int, tokens_N: torch.Tensor, feat_ND: torch.Tensor,
              keys: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Step s of every block -> (a_ND: pre-norm output, fed back; hidden_ND: LM-head input). Appends the
        step's key/value ([N, G, E]) to `keys`/`values`."""
        pos_N = ctx.pos0_N + s
        x_ND = self._input(tokens_N, feat_ND)
        xn_ND = self.attn_norm(x_ND)
        k_NGE, v_NGE = self.attn.keys_values(xn_ND, pos_N)
        keys.append(k_NGE)
        values.append(v_NGE)
        h_ND = x_ND + self.attn(xn_ND, pos_N, ctx, torch.stack(keys, dim=2), torch.stack(values, dim=2))
        a_ND = h_ND + self.ffn(self.ffn_norm(h_ND))
        return a_ND, self.final_norm(a_ND)

    def _conf(self, hidden_ND: torch.Tensor) -> torch.Tensor | None:
        return None if self.conf_proj is None else self.conf_proj(hidden_ND).squeeze(-1)

    def forward(self, batch: BlockBatch) -> DraftOutput:
        """Training forward: the training-time test over γ steps, tokens teacher-forced from the batch."""
        ctx = self._context(batch)
        tokens_NK = batch.prev_tokens_NK()  # x_p, then the true continuation x_{p+1}..x_{p+γ-1}
        feat_ND, keys, values, hidden = ctx.feat0_ND, [], [], []
        for s in range(self.cfg.block_size):  # sequential by nature; all blocks in parallel
            a_ND, h_ND = self._step(ctx, s, tokens_NK[:, s], feat_ND, keys, values)
            hidden.append(h_ND)
            feat_ND = self._feedback(a_ND)
        hidden_NKD = torch.stack(hidden, dim=1)
        conf_NK = self._conf(hidden_NKD)
        return DraftOutput(hidden_NKD, None, conf_NK, hidden_NKD.new_zeros(()))

    @torch.no_grad()
    def draft_block(self, batch: BlockBatch, temperature: float, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chain drafting, the drafter contract shared with DraftModel.draft_block: step s reads the token sampled
        at step s-1 (the anchor at s = 0). Only the batch's context and anchors are read; its tokens after the
        anchors are ignored. -> (tokens_NK, probs_NKV, raw confidence logits conf_logit_NK or None: a saturated
        sigmoid could not be turned back into a logit)."""
        ctx = self._context(batch)
        lm_VD = self.frozen_lm_head_VD
        tokens_N, feat_ND = batch.anchor_ids_N(), ctx.feat0_ND
        keys, values, tokens, probs, hidden = [], [], [], [], []
        for s in range(self.cfg.block_size):
            a_ND, h_ND = self._step(ctx, s, tokens_N, feat_ND, keys, values)
            p_NV = probs_at_temperature(h_ND.to(lm_VD.dtype) @ lm_VD.t(), temperature)
            tokens_N = sample_categorical(p_NV, generator)
            tokens.append(tokens_N)
            probs.append(p_NV)
            hidden.append(h_ND)
            feat_ND = self._feedback(a_ND)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1), self._conf(torch.stack(hidden, dim=1))

