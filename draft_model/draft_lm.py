"""Classic separate draft LM (baseline): a small causal decoder over tokens alone, drafting autoregressively.

It reads no target feature: only `BlockBatch.input_ids_T` (never ctx_feats or final_hidden; the loss reads
final_hidden for p_t as for every drafter), so the evaluator asks the target for no layers
(`reads_target_features = False`). It shares the target's frozen embedding and LM head and is trained from random
initialisation with the usual DSpark loss (CE + L1 to p_t + confidence) on target-regenerated text.

Notation: x_j is the token at position j. The input at j is u_j = W_in RMSNorm(embed(x_j)) (W_in is trainable
because the embedding is frozen), then L pre-norm decoder layers (causal GQA with RoPE over absolute positions,
SwiGLU), a final norm and the frozen head: the hidden state at j predicts x_{j+1}.

- Training (teacher forcing) is one causal pass over each packed sequence; slot k of the block anchored at p is
  the hidden state at p+k (`BlockBatch.target_index_NK`), which predicts x_{p+k+1}: a plain LM forward, no
  training-time-test unrolling (there is no feature to feed back).
- Drafting runs the same layers over the context x_0..x_{p-1} for each layer's keys/values, then step s (position
  p+s) reads x_{p+s} (the anchor, then its own sample), runs every layer for that one query against the context
  and the block's earlier steps, and samples x_{p+s+1}: γ single-token forwards, cost linear in γ.
tests/test_draft_lm.py checks that the two give the same chain.

A sliding window is refused (draft.sliding_window must be 0): with several layers a token's receptive field is
L windows wide, so the evaluator's cut of the context to one window would change the output.

Legend: T tokens in the batch, N blocks, K block size γ, W context width, S steps so far, D hidden, V vocab,
H query heads, G key/value heads, E head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draft_model.attention import StepAttention, StepContext, token_positions_T
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig
from draft_model.ffn import SwiGLU
from draft_model.model import DraftOutput, FrozenTargetDraft, resolve_cfg
from draft_model.registry import register_draft
from draft_model.sampling import probs_at_temperature, sample_categorical


class _DecoderLayer(nn.Module):
    """Pre-norm decoder layer; `causal` runs it over whole sequences, `step` for one new query per block."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.attn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.attn = StepAttention(cfg)
        self.ffn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.ffn = SwiGLU(D, cfg.resolved_intermediate_size)

    def causal(self, x_TD: torch.Tensor, pos_T: torch.Tensor, seq_start: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (output [T, D], rotated keys and values [T, G, E]); attention causal inside each sequence."""
        at = self.attn
        H, E = at.num_heads, at.head_dim
        xn_TD = self.attn_norm(x_TD)
        k_TGE, v_TGE = at.keys_values(xn_TD, pos_T)
        q_THE = at.rope(at.query_heads(xn_TD), pos_T)
        outs = []
        for a, b in zip(seq_start[:-1], seq_start[1:]):  # a few sequences per batch; SDPA per sequence
            o_HLE = F.scaled_dot_product_attention(q_THE[a:b].transpose(0, 1), k_TGE[a:b].transpose(0, 1),
                                                   v_TGE[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
            outs.append(o_HLE.transpose(0, 1).reshape(b - a, H * E))
        h_TD = x_TD + at.o_proj(torch.cat(outs))
        return h_TD + self.ffn(self.ffn_norm(h_TD)), k_TGE, v_TGE

    def step(self, x_ND: torch.Tensor, pos_N: torch.Tensor, ctx: StepContext, keys: list[torch.Tensor],
             values: list[torch.Tensor]) -> torch.Tensor:
        """One step of every block; appends the step's key/value ([N, G, E]) to this layer's `keys`/`values`."""
        xn_ND = self.attn_norm(x_ND)
        k_NGE, v_NGE = self.attn.keys_values(xn_ND, pos_N)
        keys.append(k_NGE)
        values.append(v_NGE)
        h_ND = x_ND + self.attn(xn_ND, pos_N, ctx, torch.stack(keys, dim=2), torch.stack(values, dim=2))
        return h_ND + self.ffn(self.ffn_norm(h_ND))


@register_draft("draft-lm")
class DraftLM(FrozenTargetDraft):
    reads_target_features = False  # evaluation/drafters.py asks the target for no layers

    def __init__(self, cfg: DraftConfig, embed_weight_VD: torch.Tensor, lm_head_weight_VD: torch.Tensor) -> None:
        super().__init__(embed_weight_VD, lm_head_weight_VD)
        self.cfg = cfg = resolve_cfg(cfg, embed_weight_VD, lm_head_weight_VD)  # validate(): the draft-lm checks
        D = cfg.hidden_size
        self.embed_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.in_proj = nn.Linear(D, D, bias=False)
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.conf_proj = nn.Linear(D, 1) if cfg.confidence else None

    # ---- the layers --------------------------------------------------------------------------------------------

    def _input(self, tokens_L: torch.Tensor) -> torch.Tensor:
        e_LD = self.frozen_embed_VD[tokens_L].to(self.in_proj.weight.dtype)
        return self.in_proj(self.embed_norm(e_LD))

    def _conf(self, hidden_ND: torch.Tensor) -> torch.Tensor | None:
        return None if self.conf_proj is None else self.conf_proj(hidden_ND).squeeze(-1)

    def _causal(self, batch: BlockBatch) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Every layer over every packed sequence -> (last layer's output [T, D], per-layer keys/values)."""
        if batch.block_size != self.cfg.block_size:
            raise ValueError(f"BlockBatch has block size {batch.block_size}, the draft was built for "
                             f"{self.cfg.block_size}")
        ids_T = batch.input_ids_T
        pos_T = token_positions_T(batch.seq_start_S1, ids_T.shape[0])
        seq_start = batch.host_index().seq_start_S1.tolist()
        x_TD, kv = self._input(ids_T), []
        for layer in self.layers:
            x_TD, k_TGE, v_TGE = layer.causal(x_TD, pos_T, seq_start)
            kv.append((k_TGE, v_TGE))
        return x_TD, kv

    def forward(self, batch: BlockBatch) -> DraftOutput:
        """Training forward: teacher-forced, one causal pass; slot k of a block is the state at p+k."""
        x_TD, _ = self._causal(batch)
        hidden_NKD = self.final_norm(x_TD[batch.target_index_NK()])
        return DraftOutput(hidden_NKD, None, self._conf(hidden_NKD), hidden_NKD.new_zeros(()))

    @torch.no_grad()
    def draft_block(self, batch: BlockBatch, temperature: float, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The drafter contract (DraftModel.draft_block): γ tokens per block, left to right, each step reading the
        token sampled at the step before (the anchor first). Only tokens before and at the anchors are read.
        -> (tokens_NK, probs_NKV fp32 (one-hot when greedy), conf_logit_NK or None)."""
        _, kv = self._causal(batch)  # keys of positions >= p are computed but masked: p.. are the block's steps
        index_NW, _, valid_NW = batch.context_window(0)
        ctxs = [StepContext(k_TGE[index_NW].transpose(1, 2).contiguous(),
                              v_TGE[index_NW].transpose(1, 2).contiguous(), valid_NW) for k_TGE, v_TGE in kv]
        lm_VD = self.frozen_lm_head_VD
        tokens_N, p_N = batch.anchor_ids_N(), batch.anchor_pos_N
        keys = [[] for _ in self.layers]
        values = [[] for _ in self.layers]
        tokens, probs, hidden = [], [], []
        for s in range(self.cfg.block_size):
            x_ND = self._input(tokens_N)
            for layer, ctx, k, v in zip(self.layers, ctxs, keys, values):
                x_ND = layer.step(x_ND, p_N + s, ctx, k, v)
            h_ND = self.final_norm(x_ND)
            p_NV = probs_at_temperature(h_ND.to(lm_VD.dtype) @ lm_VD.t(), temperature)
            tokens_N = sample_categorical(p_NV, generator)
            tokens.append(tokens_N)
            probs.append(p_NV)
            hidden.append(h_ND)
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1), self._conf(torch.stack(hidden, dim=1))
