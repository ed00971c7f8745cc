"""Block attention with injected target context (DFlash/DSpark).

Queries come from the block's γ slots only; keys/values are [W_K H_ctx_window ; W_K h_block] (V likewise), so
every layer re-reads the projected target context. A block sees its own sequence's context strictly before its
anchor (and within the sliding window), its own slots bidirectionally, and never another block.

Implementations of the same attention (`draft.attn_impl`), proven equal by tests/test_attention_paths.py:
- "packed" (default) picks its kernel by device. On CUDA: one flex-attention call over the flat token axis
  [context rows | block slots] with a BlockMask built from the packer's index arrays (flex_layout.py): no per-block
  window copies, KV heads kept grouped; torch-compiled, since eager flex attention would materialise the scores.
  Elsewhere (torch 2.13's flex attention has no backward on CPU): blocks are grouped (block_layout.py: a sequence
  per group for full context, a block per group for SWA); each group's context keys are one contiguous range of
  rows read by all its blocks, so K/V are copied about once per token instead of once per block, and one
  [R, 1, Q, L] mask built on the host once per forward serves every layer. SDPA over it runs torch's flash
  kernel on CPU (mask + GQA, forward and backward).
- "flex": the flex-attention kernel on any device (on a CPU: forward only, eager; the tests compare it there;
  eager flex computes every score, so its tile lists are checked directly, not through the output).
- "gather": the reference. Each block gathers its own window densely (BlockBatch.context_window: [N, W] rows),
  N x W key rows per layer: fine for SWA, prohibitive for full context at production lengths.

Context keys are projected and rotated once per token row in either path: the reference does all T rows, the
packed path only the U rows some block reads (a sliding window with sparse anchors leaves most rows unread).
RoPE's cos/sin tables are built once per forward (AttnContext) and shared by every layer.

StepAttention is the other attention here: one new query per block over its gathered context keys and its own
earlier steps, for the drafters that draft step by step (eagle3.py, draft_lm.py).

Legend: T tokens in the batch, U context rows attention reads (packed path; T in the reference), N blocks,
K block size γ, W context window width (widest in batch), D hidden, H query heads, G key/value heads, E head dim;
packed path: R groups, B blocks per group, C context rows per group, Q = B*K query rows, L = C + Q keys.
StepAttention: W context keys per block, S steps so far, R = H/G query heads per key/value head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from draft_model.batch import BlockBatch
from draft_model.block_layout import GroupLayout, group_layout
from draft_model.config import DraftConfig
from draft_model.flex_layout import FlexLayout, flex_layout
from draft_model.rope import RotaryEmbedding, apply_rope, rope_tables

# devices whose SDPA kernel takes a boolean mask and grouped KV heads together (CPU flash attention does)
MASKED_GQA_NATIVE = {"cpu"}


@dataclass
class AttnContext:
    """Everything attention needs besides the block hidden states; built once per forward, shared by layers."""

    ctx_UD: torch.Tensor  # fused target context H_ctx of the U token rows attention reads (gather path: all T)
    rope_ctx: tuple[torch.Tensor, torch.Tensor]  # cos/sin [U, 1, E] at each of those rows' position in its sequence
    rope_slot: tuple[torch.Tensor, torch.Tensor]  # cos/sin [N, K, 1, E] at each block slot's position p + k
    layout: GroupLayout | None = None  # "packed" path, grouped SDPA (off CUDA)
    flex: FlexLayout | None = None  # "packed" path on CUDA, and "flex"
    index_NW: torch.Tensor | None = None  # "gather" path: flat token row of each context key (0 where invalid)
    mask_N1KL: torch.Tensor | None = None  # "gather" path: bool [N, 1, K, W + K], True = may attend

    @staticmethod
    def build(batch: BlockBatch, cfg: DraftConfig, fuse: Callable[[torch.Tensor], torch.Tensor]) -> AttnContext:
        """`fuse` turns context feature rows [*, F] into H_ctx rows [*, D]. The packed path runs it only on the
        rows some block reads (GroupLayout.ctx_row_U); the reference path on every token."""
        E = cfg.resolved_head_dim
        pos_T = token_positions_T(batch.seq_start_S1, batch.ctx_feats_TF.shape[0])
        rope_slot = rope_tables(batch.slot_positions_NK(), E, cfg.rope_theta)
        device = batch.ctx_feats_TF.device
        if cfg.attn_impl == "flex" or (cfg.attn_impl == "packed" and device.type == "cuda"):
            flex = flex_layout(batch.host_index(), cfg.sliding_window, cfg.block_size, device)
            rows_U = flex.ctx_row_U
            return AttnContext(fuse(batch.ctx_feats_TF.index_select(0, rows_U)),
                               rope_tables(pos_T.index_select(0, rows_U), E, cfg.rope_theta), rope_slot, flex=flex)
        if cfg.attn_impl == "packed":
            layout = group_layout(batch.host_index(), cfg.sliding_window, cfg.block_size, batch.ctx_feats_TF.device)
            rows_U = layout.ctx_row_U
            return AttnContext(fuse(batch.ctx_feats_TF.index_select(0, rows_U)),
                               rope_tables(pos_T.index_select(0, rows_U), E, cfg.rope_theta), rope_slot,
                               layout=layout)
        index_NW, _, valid_NW = batch.context_window(cfg.sliding_window)
        N, K, W = index_NW.shape[0], cfg.block_size, index_NW.shape[1]
        ctx_mask_NKW = valid_NW[:, None, :].expand(N, K, W)
        block_mask_NKK = torch.ones(N, K, K, dtype=torch.bool, device=valid_NW.device)  # bidirectional
        mask = torch.cat([ctx_mask_NKW, block_mask_NKK], dim=-1)[:, None]
        return AttnContext(fuse(batch.ctx_feats_TF), rope_tables(pos_T, E, cfg.rope_theta), rope_slot,
                           index_NW=index_NW, mask_N1KL=mask)


def token_positions_T(seq_start_S1: torch.Tensor, T: int) -> torch.Tensor:
    """Position of every flat token inside its own sequence (T passed in: no device->host sync)."""
    lengths_S = seq_start_S1[1:] - seq_start_S1[:-1]
    seq_T = torch.repeat_interleave(torch.arange(lengths_S.numel(), device=seq_start_S1.device), lengths_S,
                                    output_size=T)
    return torch.arange(T, device=seq_start_S1.device) - seq_start_S1[seq_T]


class GQAProjections(nn.Module):
    """Query/key/value/output projections with grouped KV heads and RoPE, shared by the draft attentions.

    With `draft.qk_norm` every query and key head is RMS-normalised over its head dim (one weight [E] for queries,
    one for keys, Qwen3's q_norm/k_norm) before RoPE: what the engines' DFlash/DSpark layers apply."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D, E = cfg.hidden_size, cfg.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, E
        self.q_proj = nn.Linear(D, cfg.num_heads * E, bias=False)
        self.k_proj = nn.Linear(D, cfg.num_kv_heads * E, bias=False)
        self.v_proj = nn.Linear(D, cfg.num_kv_heads * E, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * E, D, bias=False)
        self.q_norm = nn.RMSNorm(E, eps=cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(E, eps=cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = RotaryEmbedding(E, cfg.rope_theta)

    def query_heads(self, x_LD: torch.Tensor) -> torch.Tensor:
        """Un-rotated queries [..., H, E] of normed inputs [..., D]."""
        q = self.q_proj(x_LD).unflatten(-1, (self.num_heads, self.head_dim))
        return q if self.q_norm is None else self.q_norm(q)

    def key_heads(self, x_LD: torch.Tensor) -> torch.Tensor:
        """Un-rotated keys [..., G, E] of normed inputs [..., D]."""
        k = self.k_proj(x_LD).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return k if self.k_norm is None else self.k_norm(k)


class ContextBlockAttention(GQAProjections):
    def forward(self, x_NKD: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        N, K, _ = x_NKD.shape
        H, G, E = self.num_heads, self.num_kv_heads, self.head_dim
        U = ctx.ctx_UD.shape[0]
        q_NKHE = apply_rope(self.query_heads(x_NKD), ctx.rope_slot)
        kb_NKGE = apply_rope(self.key_heads(x_NKD), ctx.rope_slot)
        vb_NKGE = self.v_proj(x_NKD).view(N, K, G, E)
        # context keys at their own absolute positions, computed once per token, then laid out per block/group
        kc_UGE = apply_rope(self.key_heads(ctx.ctx_UD), ctx.rope_ctx)
        vc_UGE = self.v_proj(ctx.ctx_UD).view(U, G, E)
        if ctx.flex is not None:
            out_NKHE = self._flex(q_NKHE, kb_NKGE, vb_NKGE, kc_UGE, vc_UGE, ctx.flex.block_mask)
        elif ctx.layout is not None:
            out_NKHE = self._packed(q_NKHE, kb_NKGE, vb_NKGE, kc_UGE, vc_UGE, ctx.layout)
        else:
            k_NLGE = torch.cat([kc_UGE[ctx.index_NW], kb_NKGE], dim=1)
            v_NLGE = torch.cat([vc_UGE[ctx.index_NW], vb_NKGE], dim=1)
            out_NHKE = F.scaled_dot_product_attention(
                q_NKHE.transpose(1, 2), k_NLGE.transpose(1, 2), v_NLGE.transpose(1, 2),
                attn_mask=ctx.mask_N1KL, enable_gqa=H != G)
            out_NKHE = out_NHKE.transpose(1, 2)
        return self.o_proj(out_NKHE.reshape(N, K, H * E))

    def _flex(self, q_NKHE: torch.Tensor, kb_NKGE: torch.Tensor, vb_NKGE: torch.Tensor, kc_UGE: torch.Tensor,
              vc_UGE: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
        N, K, H, E = q_NKHE.shape
        G = kb_NKGE.shape[2]
        q_1HQE = q_NKHE.reshape(1, N * K, H, E).transpose(1, 2)
        k_1GLE = torch.cat([kc_UGE, kb_NKGE.reshape(N * K, G, E)]).transpose(0, 1)[None]
        v_1GLE = torch.cat([vc_UGE, vb_NKGE.reshape(N * K, G, E)]).transpose(0, 1)[None]
        out_1HQE = flex_kernel(q_NKHE.device)(q_1HQE, k_1GLE, v_1GLE, block_mask=block_mask, enable_gqa=H != G)
        return out_1HQE.transpose(1, 2).reshape(N, K, H, E)

    def _packed(self, q_NKHE: torch.Tensor, kb_NKGE: torch.Tensor, vb_NKGE: torch.Tensor, kc_UGE: torch.Tensor,
                vc_UGE: torch.Tensor, lay: GroupLayout) -> torch.Tensor:
        N, K, H, E = q_NKHE.shape
        G = kb_NKGE.shape[2]
        R, B = lay.block_RB.shape

        def per_group(x_NK__: torch.Tensor) -> torch.Tensor:  # [N, K, h, E] -> [R, B*K, h, E], zero pad row N
            padded = torch.cat([x_NK__, x_NK__.new_zeros((1,) + x_NK__.shape[1:])])
            return take_rows(padded, lay.block_RB).reshape(R, B * K, x_NK__.shape[2], E)

        k_RLGE = torch.cat([take_rows(kc_UGE, lay.key_row_RC), per_group(kb_NKGE)], dim=1)
        v_RLGE = torch.cat([take_rows(vc_UGE, lay.key_row_RC), per_group(vb_NKGE)], dim=1)
        gqa = H != G
        if gqa and q_NKHE.device.type not in MASKED_GQA_NATIVE:
            # CUDA's masked kernel (memory-efficient attention) takes no GQA; without it SDPA would fall back to
            # the math kernel and materialise [R, H, Q, L] scores. Repeating the G heads costs only H/G x the
            # group's K/V. (The CPU flash kernel takes mask and GQA together.)
            k_RLGE, v_RLGE = (x.repeat_interleave(H // G, dim=2) for x in (k_RLGE, v_RLGE))
            gqa = False
        out_RHQE = F.scaled_dot_product_attention(
            per_group(q_NKHE).transpose(1, 2), k_RLGE.transpose(1, 2), v_RLGE.transpose(1, 2),
            attn_mask=lay.mask_R1QL, enable_gqa=gqa)
        return take_rows(out_RHQE.transpose(1, 2).reshape(R * B, K, H, E), lay.slot_of_N)


@dataclass
class StepContext:
    """What StepAttention reads besides the step's own keys: the context keys/values gathered per block."""

    k_NGWE: torch.Tensor  # rotated context keys
    v_NGWE: torch.Tensor
    valid_NW: torch.Tensor  # bool: which context columns are real keys


class StepAttention(GQAProjections):
    """Causal GQA attention for one new query per block over [context keys ; the block's earlier steps]: the
    step-by-step drafters' attention (eagle3.py, draft_lm.py).

    The two key sets are scored separately and share one softmax, so the (large) gathered context K/V is never
    concatenated with the step keys: a per-step concatenation would copy N*W*G*E values γ times and keep each copy
    alive for the backward.
    """

    def keys_values(self, x_LD: torch.Tensor, pos_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [L, G, E] of normed inputs x at positions pos (any leading shape L)."""
        G, E = self.num_kv_heads, self.head_dim
        return self.rope(self.key_heads(x_LD), pos_L), self.v_proj(x_LD).unflatten(-1, (G, E))

    def forward(self, x_ND: torch.Tensor, pos_N: torch.Tensor, ctx: StepContext, k_NGSE: torch.Tensor,
                v_NGSE: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        H, G, E = self.num_heads, self.num_kv_heads, self.head_dim
        q_NGRE = self.rope(self.query_heads(x_ND), pos_N).view(N, G, H // G, E) * E ** -0.5
        s_ctx_NGRW = (q_NGRE @ ctx.k_NGWE.transpose(-1, -2)).float()
        s_ctx_NGRW = s_ctx_NGRW.masked_fill(~ctx.valid_NW[:, None, None, :], float("-inf"))
        s_own_NGRS = (q_NGRE @ k_NGSE.transpose(-1, -2)).float()  # every earlier step and itself: all visible
        probs = torch.softmax(torch.cat([s_ctx_NGRW, s_own_NGRS], dim=-1), dim=-1).to(x_ND.dtype)
        W = s_ctx_NGRW.shape[-1]
        out_NGRE = probs[..., :W] @ ctx.v_NGWE + probs[..., W:] @ v_NGSE
        return self.o_proj(out_NGRE.reshape(N, H * E))


_compiled_flex: Callable | None = None


def flex_kernel(device: torch.device) -> Callable:
    """flex_attention as it must run on `device`: compiled on CUDA (the fused Triton kernel; uncompiled, flex
    attention computes the full score matrix), eager elsewhere (CPU forward). Compiled once, dynamic shapes: the
    token and block counts change every batch."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 for an integer index of any shape, through index_select: its backward is index_add_,
    faster on a CPU than the index_put_(accumulate=True) that advanced indexing's backward uses
    (docs/design-notes.md, "Measured kernels")."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])
