"""Block attention with injected target context (DFlash/DSpark).

Queries come from the block's γ slots only; keys/values are [W_K H_ctx_window ; W_K h_block] (V likewise), so
every layer re-reads the projected target context. Each block gathers its own context rows densely
(BlockBatch.context_window: [N, W] indices + valid mask) and attends with one boolean mask over the W + K keys,
batched over all blocks: no per-block Python loop. A block sees its own sequence's context strictly before its
anchor (and within the sliding window), its own slots bidirectionally, and never another block: the other
blocks' slots are simply not among its keys.

Context keys are projected and rotated once per token (T rows) and then gathered, which is cheaper than
projecting N*W gathered rows when blocks of one sequence share context (the usual case).

Legend: T tokens in the batch, N blocks, K block size γ, W context window width (widest in batch),
D hidden, H query heads, G key/value heads, E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draft_model.config import DraftConfig
from draft_model.rope import RotaryEmbedding


@dataclass
class AttnContext:
    """Everything attention needs besides the block hidden states; built once per forward, shared by layers."""

    ctx_TD: torch.Tensor  # fused target context H_ctx per token
    pos_T: torch.Tensor  # int64 position of each token inside its sequence
    index_NW: torch.Tensor  # int64 flat token row of each context key of each block (0 where invalid)
    slot_pos_NK: torch.Tensor  # int64 absolute position p + k of each block slot
    mask_N1KL: torch.Tensor  # bool [N, 1, K, W + K]: True = may attend

    @staticmethod
    def build(ctx_TD: torch.Tensor, pos_T: torch.Tensor, index_NW: torch.Tensor, valid_NW: torch.Tensor,
              slot_pos_NK: torch.Tensor) -> AttnContext:
        N, K = slot_pos_NK.shape
        W = index_NW.shape[1]
        ctx_mask_NKW = valid_NW[:, None, :].expand(N, K, W)
        block_mask_NKK = torch.ones(N, K, K, dtype=torch.bool, device=valid_NW.device)  # bidirectional
        mask = torch.cat([ctx_mask_NKW, block_mask_NKK], dim=-1)[:, None]
        return AttnContext(ctx_TD, pos_T, index_NW, slot_pos_NK, mask)


class GQAProjections(nn.Module):
    """Query/key/value/output projections with grouped KV heads and RoPE, shared by the draft attentions."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D, E = cfg.hidden_size, cfg.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, E
        self.q_proj = nn.Linear(D, cfg.num_heads * E, bias=False)
        self.k_proj = nn.Linear(D, cfg.num_kv_heads * E, bias=False)
        self.v_proj = nn.Linear(D, cfg.num_kv_heads * E, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * E, D, bias=False)
        self.rope = RotaryEmbedding(E, cfg.rope_theta)


class ContextBlockAttention(GQAProjections):
    def forward(self, x_NKD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        N, K, _ = x_NKD.shape
        H, G, E = self.num_heads, self.num_kv_heads, self.head_dim
        T = ctx.ctx_TD.shape[0]
        q_NKHE = self.rope(self.q_proj(x_NKD).view(N, K, H, E), ctx.slot_pos_NK)
        kb_NKGE = self.rope(self.k_proj(x_NKD).view(N, K, G, E), ctx.slot_pos_NK)
        vb_NKGE = self.v_proj(x_NKD).view(N, K, G, E)
        # context keys at their own absolute positions, computed per token, then gathered per block
        kc_TGE = self.rope(self.k_proj(ctx.ctx_TD).view(T, G, E), ctx.pos_T)
        vc_TGE = self.v_proj(ctx.ctx_TD).view(T, G, E)
        k_NLGE = torch.cat([kc_TGE[ctx.index_NW], kb_NKGE], dim=1)
        v_NLGE = torch.cat([vc_TGE[ctx.index_NW], vb_NKGE], dim=1)
        out_NHKE = F.scaled_dot_product_attention(
            q_NKHE.transpose(1, 2), k_NLGE.transpose(1, 2), v_NLGE.transpose(1, 2),
            attn_mask=ctx.mask_N1KL, enable_gqa=H != G)
        return self.o_proj(out_NHKE.transpose(1, 2).reshape(N, K, H * E))
