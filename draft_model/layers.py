"""The parallel draft backbone (DFlash-style): context fusion, block input, decoder layers, final norm.

Block n's input is [embed(x_0), m, ..., m] (γ slots); slot k predicts the token at p+k+1. The mask m is a learned
vector (`draft.mask=learned`) or the frozen target embedding row of `draft.mask_token_id` (`token`: the engines'
form, nothing of it trained or shipped). The configured target layers' hidden states (ctx_feats, F = m*D) are
fused once per token by Linear(F->D) + RMSNorm into H_ctx, which every layer's attention reads as extra
keys/values (attention.py). Each layer is pre-norm attention + FFN (dense SwiGLU or MoE), with a plain residual
or mHC streams.

Legend: T tokens, N blocks, K block size γ, W context width, D hidden, F context feature width, n mHC streams.
"""

from __future__ import annotations

import torch
from torch import nn

from draft_model.attention import AttnContext, ContextBlockAttention
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig
from draft_model.ffn import SwiGLU
from draft_model.mhc import MHCConnection, expand_streams, reduce_streams
from draft_model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.attn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.attn = ContextBlockAttention(cfg)
        self.ffn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.ffn = MoE(D, cfg.moe) if cfg.ffn == "moe" else SwiGLU(D, cfg.resolved_intermediate_size)
        self.mhc = cfg.residual == "mhc"
        if self.mhc:
            self.attn_res = MHCConnection(cfg.mhc_streams, D, cfg.mhc_sinkhorn_iters, cfg.rms_norm_eps)
            self.ffn_res = MHCConnection(cfg.mhc_streams, D, cfg.mhc_sinkhorn_iters, cfg.rms_norm_eps)

    def _attn(self, h_NKD: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn(self.attn_norm(h_NKD), ctx), h_NKD.new_zeros(())

    def _ffn(self, h_NKD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.ffn_norm(h_NKD)
        if isinstance(self.ffn, MoE):
            y_TD, aux = self.ffn(x.reshape(-1, x.shape[-1]))
            return y_TD.view_as(x), aux
        return self.ffn(x), h_NKD.new_zeros(())

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x is [N, K, D] (plain) or [N, K, n, D] (mHC streams) -> (same shape, aux loss)."""
        if self.mhc:
            x, aux_a = self.attn_res(x, lambda h: self._attn(h, ctx))
            x, aux_f = self.ffn_res(x, self._ffn)
            return x, aux_a + aux_f
        y, aux_a = self._attn(x, ctx)
        x = x + y
        y, aux_f = self._ffn(x)
        return x + y, aux_a + aux_f


class DraftBackbone(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.cfg = cfg
        self.ctx_width = len(cfg.target_layers) * D
        self.ctx_proj = nn.Linear(self.ctx_width, D, bias=False)
        self.ctx_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        if cfg.mask == "learned":
            self.mask_embed_D = nn.Parameter(torch.randn(D) * 0.02)
        elif cfg.mask_token_id < 0:
            raise ValueError("draft.mask='token' needs draft.mask_token_id (the launcher chooses it from the target's "
                             "tokenizer when it is -1; a draft built directly must name it)")
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)

    def forward(self, batch: BlockBatch, embed_VD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden_NKD after the final norm = LM-head input, summed MoE aux loss)."""
        if batch.ctx_feats_TF.shape[1] != self.ctx_width:
            raise ValueError(f"BlockBatch.ctx_feats has width {batch.ctx_feats_TF.shape[1]}, but the draft expects "
                             f"{self.ctx_width} = {len(self.cfg.target_layers)} target layers x hidden "
                             f"{self.cfg.hidden_size}")
        K = self.cfg.block_size
        if batch.block_size != K:
            raise ValueError(f"BlockBatch has block size {batch.block_size}, the draft was built for {K}")
        dtype = self.ctx_proj.weight.dtype
        ctx = AttnContext.build(batch, self.cfg, lambda feats_UF: self.ctx_norm(self.ctx_proj(feats_UF.to(dtype))))

        anchor_ND = embed_VD[batch.anchor_ids_N()].to(dtype)
        N = anchor_ND.shape[0]
        mask_D = self.mask_embed_D if self.cfg.mask == "learned" else embed_VD[self.cfg.mask_token_id].to(dtype)
        x = torch.cat([anchor_ND[:, None, :], mask_D.expand(N, K - 1, -1)], dim=1)
        if self.cfg.residual == "mhc":
            x = expand_streams(x, self.cfg.mhc_streams)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x, ctx)
            aux = aux + layer_aux
        if self.cfg.residual == "mhc":
            x = reduce_streams(x)
        return self.final_norm(x), aux
