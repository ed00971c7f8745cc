"""DeepSeek-V4's DSpark drafter block (arch "dsv4", preset "v4-deepseek"): the one MoE + hyper-connection draft
that the engines serve (llama.cpp's DFLASH arch with hyper_connection.count > 0, vLLM's
DSparkDeepseekV4ForCausalLM), trained here on any target whose hidden size it has.

Read from llama.cpp b11434 (src/models/dflash.cpp `graph_dsv4`, src/models/deepseek4.cpp `build_hc_*`,
`build_attention_impl`, src/llama-graph.cpp `build_moe_ffn`) and from vLLM's DeepSeek-V4 DSpark model; the
window rule from ports of DeepSeek's reference (docs/dsv4.md says which parts are exactly DeepSeek's).

    main_x  = main_norm(main_proj([target layer inputs]))             context, once per token row
    x       = 4 streams, each the block's token embeddings [anchor, noise token x (γ-1)]
    per stage:  h, post, comb = hc_pre(x; hc_attn_*) ; x = hc_post(attn(attn_norm(h)), x, post, comb)
                h, post, comb = hc_pre(x; hc_ffn_*)  ; x = hc_post(moe(ffn_norm(h)) + shared, x, post, comb)
    h_pre   = hc_head(x)                 the confidence head reads this (before the final norm)
    hidden  = norm(h_pre)                the target's frozen LM head multiplies this

Hyper-connections (DeepSeek's): mixes = fn · (flat / rms(flat)) over the 4·D flattened streams;
pre = σ(mixes[0:4]·scale[0] + base[0:4]) + hc_eps, post = 2σ(mixes[4:8]·scale[1] + base[4:8]),
comb = Sinkhorn(mixes[8:24]·scale[2] + base[8:24]) laid out [src, dst]: softmax over dst, + eps, then normalise over
src, then (iters-1) x (over dst, over src), eps in every denominator. h = Σ pre_i x_i;
x'_dst = post_dst · f + Σ_src comb[src, dst] x_src. hc_head: σ(fn_head · flat/rms · scale + base) + hc_eps weights.

Attention: one shared head `kv` that is both K and V (MQA), from wkv then a weighted RMSNorm, the context's from
main_x at each row's own position; queries through a LoRA (wq_a, weighted q_norm, wq_b), then a weightless
RMSNorm per head; GPT-J (interleaved pairs) RoPE on the trailing rope_head_dim dims of q and kv; softmax over
[scores · E^-1/2 ; attn_sink per head] with the sink's share dropped; the output's rotated dims turned back at the
query's position (V carried the rotation); grouped output LoRA: heads in o_groups groups, each group through its
own wo_a block, the concatenation through wo_b. Every slot of a block sees the same context window [p - W, p) (the
reference's rule; llama.cpp's mask slides it per slot, docs/dsv4.md) and its whole block.

MoE: draft_model/moe.py with score_func sqrtsoftplus and routed_scaling_factor (selection by score + bias, weights
the chosen scores renormalised and scaled); shared experts added. Markov head: heads.MarkovHead. Confidence:
σ(conf_proj · [h_pre ; W1[x_{k-1}]]), no bias (the DeepSeek checkpoint has none).

`STAGE_NAMES` and `ROOT_NAMES` map this module's state_dict names to llama.cpp's GGUF tensor names (`blk.<i>.`) and
to the DeepSeek-V4 checkpoint's (`mtp.<stage>.`); `export_state` applies either: renames, plus a transpose of the
tensors in `TRANSPOSED` (the routed experts, kept [E, D, I] / [E, I, D] by draft_model/moe.py, and the Markov W2,
kept [R, V] by heads.py, where the engines store [E, I, D] / [E, D, I] and [V, R]).

Legend: T tokens, N blocks, K block size γ, n hyper-connection streams, D hidden, F context features, H query heads,
E head dim, Rd rope dims, W context window, L = W + K keys, G output groups, Ro output LoRA rank, R Markov rank.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draft_model.attention import take_rows, token_positions_T
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig
from draft_model.heads import MarkovHead
from draft_model.model import DraftOutput, FrozenTargetDraft, resolve_cfg
from draft_model.moe import MoE
from draft_model.registry import register_draft

IDENTITY_GAP = 4.0  # comb logits at init: 4 on the diagonal, so each stream starts mostly as itself
HC_SCALE_INIT = 0.01  # the dynamic parts start small (the mHC paper's alpha), so the connection starts static


# ---- hyper-connections ------------------------------------------------------------------------------------------

def hc_sinkhorn(comb_Bnn: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """DeepSeek's Sinkhorn on [src, dst] logits: softmax over dst + eps, normalise over src, then (iters - 1) x
    (over dst, over src), eps in every denominator. Ends with Σ_src = 1."""
    comb = torch.softmax(comb_Bnn, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_mixes(x_BnD: torch.Tensor, fn_MF: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fn · (flat / rms(flat)) in fp32, the RMS weightless over all n·D values."""
    flat = x_BnD.flatten(-2).float()
    return F.linear(flat, fn_MF.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def hc_pre(x_BnD: torch.Tensor, fn_MF: torch.Tensor, scale_3: torch.Tensor, base_M: torch.Tensor, iters: int,
           norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (h_BD = Σ pre_i x_i, post_Bn, comb_Bnn [src, dst]); the mixing in fp32."""
    n = x_BnD.shape[-2]
    s = scale_3.float()
    scale_M = torch.cat([s[0].expand(n), s[1].expand(n), s[2].expand(n * n)])
    mix = hc_mixes(x_BnD, fn_MF, norm_eps) * scale_M + base_M.float()
    pre = torch.sigmoid(mix[..., :n]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[..., n:2 * n])
    comb = hc_sinkhorn(mix[..., 2 * n:].unflatten(-1, (n, n)), iters, hc_eps)
    h = (pre.to(x_BnD.dtype)[..., None, :] @ x_BnD).squeeze(-2)
    return h, post, comb


def hc_post(f_BD: torch.Tensor, x_BnD: torch.Tensor, post_Bn: torch.Tensor, comb_Bnn: torch.Tensor) -> torch.Tensor:
    """x'_dst = post_dst · f + Σ_src comb[src, dst] x_src."""
    dtype = x_BnD.dtype
    return torch.addcmul(comb_Bnn.to(dtype).transpose(-1, -2) @ x_BnD, post_Bn.to(dtype)[..., None],
                         f_BD[..., None, :])


def hc_params(n: int, D: int, rows: int, base_M: torch.Tensor, scales: int) -> tuple[nn.Parameter, ...]:
    fn = nn.Parameter(torch.randn(rows, n * D) * 0.02)
    return fn, nn.Parameter(base_M), nn.Parameter(torch.full((scales,), HC_SCALE_INIT))


def pre_logit(n: int, hc_eps: float) -> float:
    """The base logit whose pre weight σ(b) + hc_eps is 1/n: the streams' mean."""
    p = 1.0 / n - hc_eps
    return math.log(p / (1.0 - p))


class HCHead(nn.Module):
    """The read-out of the streams: h = Σ_i (σ(fn · flat/rms · scale + base)_i + hc_eps) x_i. A module of its own
    (not tensors of the draft itself), so that ZeRO-3 gathers them again for the backward: its hooks find tensors
    a module returns, and the draft returns a DraftOutput."""

    def __init__(self, n: int, D: int, norm_eps: float, hc_eps: float) -> None:
        super().__init__()
        self.norm_eps, self.hc_eps = norm_eps, hc_eps
        self.fn, self.base, self.scale = hc_params(n, D, n, torch.full((n,), pre_logit(n, hc_eps)), 1)

    def forward(self, x_BnD: torch.Tensor) -> torch.Tensor:
        mix = hc_mixes(x_BnD, self.fn, self.norm_eps) * self.scale.float() + self.base.float()
        pre = torch.sigmoid(mix) + self.hc_eps
        return (pre.to(x_BnD.dtype)[..., None, :] @ x_BnD).squeeze(-2)


# ---- RoPE: GPT-J interleaved pairs on the trailing dims ----------------------------------------------------------

def rope_tables(pos: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [..., Rd/2] for integer positions [...]: pair i turns by pos · theta^(-2i/Rd)."""
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, device=pos.device, dtype=torch.float32) / rope_dim)
    angle = pos.to(torch.float32)[..., None] * inv
    return angle.cos(), angle.sin()


def rope_trailing(x_E: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
                  ) -> torch.Tensor:
    """Rotate the last Rd dims of x [..., E] in adjacent pairs (2i, 2i+1); `inverse` turns them back. The tables'
    leading shape broadcasts against x's without its last dim."""
    cos, sin = tables
    rd = 2 * cos.shape[-1]
    x = x_E.float()
    keep, rot = x[..., :-rd], x[..., -rd:].unflatten(-1, (rd // 2, 2))
    x0, x1 = rot[..., 0], rot[..., 1]
    sin = -sin if inverse else sin
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([keep, out], dim=-1).to(x_E.dtype)


# ---- attention ----------------------------------------------------------------------------------------------------

class GroupedLoRA(nn.Module):
    """wo_a: heads in G groups, group g through its own [Ro, H*E/G] block of one [G*Ro, H*E/G] weight (DeepSeek's
    layout). A module with its own forward, so that ZeRO-3 gathers the weight when it runs."""

    def __init__(self, group_dim: int, groups: int, rank: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * rank, group_dim))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default

    def forward(self, x_NKGd: torch.Tensor) -> torch.Tensor:
        w_GRd = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("nkgd,grd->nkgr", x_NKGd, w_GRd).flatten(-2)


class DSV4Attention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D, H, E, d = cfg.hidden_size, cfg.num_heads, cfg.resolved_head_dim, cfg.dsv4
        self.H, self.E, self.G, self.eps = H, E, d.o_groups, cfg.rms_norm_eps
        self.wq_a = nn.Linear(D, d.q_lora_rank, bias=False)
        self.q_norm = nn.RMSNorm(d.q_lora_rank, eps=cfg.rms_norm_eps)
        self.wq_b = nn.Linear(d.q_lora_rank, H * E, bias=False)
        self.wkv = nn.Linear(D, E, bias=False)
        self.kv_norm = nn.RMSNorm(E, eps=cfg.rms_norm_eps)
        self.wo_a = GroupedLoRA(H * E // d.o_groups, d.o_groups, d.o_lora_rank)
        self.wo_b = nn.Linear(d.o_groups * d.o_lora_rank, D, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))

    def kv(self, x_LD: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The shared K = V head [..., E] of normed inputs, rotated at their positions."""
        return rope_trailing(self.kv_norm(self.wkv(x_LD)), tables)

    def forward(self, x_NKD: torch.Tensor, ctx: DSV4Context, kv_ctx_TE: torch.Tensor) -> torch.Tensor:
        N, K, _ = x_NKD.shape
        H, E, G = self.H, self.E, self.G
        q = self.wq_b(self.q_norm(self.wq_a(x_NKD))).unflatten(-1, (H, E))
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)  # weightless, per head
        cos, sin = ctx.rope_slot
        q_NKHE = rope_trailing(q, (cos[..., None, :], sin[..., None, :]))
        kv_NLE = torch.cat([take_rows(kv_ctx_TE, ctx.index_NW), self.kv(x_NKD, ctx.rope_slot)], dim=1)
        scores_NHKL = torch.einsum("nkhe,nle->nhkl", q_NKHE.float(), kv_NLE.float()) * E ** -0.5
        scores_NHKL = scores_NHKL.masked_fill(~ctx.mask_N11L, float("-inf"))
        sink_NHK1 = self.attn_sink.float()[None, :, None, None].expand(N, H, K, 1)
        probs_NHKL = torch.softmax(torch.cat([scores_NHKL, sink_NHK1], dim=-1), dim=-1)[..., :-1]
        out_NKHE = torch.einsum("nhkl,nle->nkhe", probs_NHKL.to(kv_NLE.dtype), kv_NLE)
        out_NKHE = rope_trailing(out_NKHE, (cos[..., None, :], sin[..., None, :]), inverse=True)
        return self.wo_b(self.wo_a(out_NKHE.reshape(N, K, G, H * E // G)))


class DSV4Context:
    """What every stage's attention reads besides the block: the fused context rows, the window each block reads
    and the RoPE tables; built once per forward."""

    def __init__(self, batch: BlockBatch, cfg: DraftConfig, main_x_TD: torch.Tensor) -> None:
        rd = cfg.dsv4.rope_head_dim
        self.main_x_TD = main_x_TD
        pos_T = token_positions_T(batch.seq_start_S1, main_x_TD.shape[0])
        self.rope_ctx = rope_tables(pos_T, rd, cfg.rope_theta)
        self.rope_slot = rope_tables(batch.slot_positions_NK(), rd, cfg.rope_theta)
        # every slot sees the same context [p - W, p) (DeepSeek's reference) and the whole block
        self.index_NW, _, valid_NW = batch.context_window(cfg.sliding_window)
        N, K = valid_NW.shape[0], cfg.block_size
        block_NK = torch.ones(N, K, dtype=torch.bool, device=valid_NW.device)
        self.mask_N11L = torch.cat([valid_NW, block_NK], dim=1)[:, None, None, :]


# ---- a stage and the model --------------------------------------------------------------------------------------

class DSV4Block(nn.Module):
    """One drafter stage: hyper-connected attention, then hyper-connected MoE + shared experts."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        D, n = cfg.hidden_size, cfg.mhc_streams
        self.iters, self.eps, self.hc_eps = cfg.mhc_sinkhorn_iters, cfg.rms_norm_eps, cfg.dsv4.hc_eps
        base = torch.cat([torch.full((n,), pre_logit(n, self.hc_eps)), torch.zeros(n),
                          (IDENTITY_GAP * torch.eye(n)).flatten()])
        rows = (2 + n) * n
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_params(n, D, rows, base.clone(), 3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_params(n, D, rows, base.clone(), 3)
        self.attn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.attn = DSV4Attention(cfg)
        self.ffn_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.ffn = MoE(D, cfg.moe)

    def forward(self, x_NKnD: torch.Tensor, ctx: DSV4Context) -> tuple[torch.Tensor, torch.Tensor]:
        hc = dict(iters=self.iters, norm_eps=self.eps, hc_eps=self.hc_eps)
        kv_ctx_TE = self.attn.kv(ctx.main_x_TD, ctx.rope_ctx)
        h, post, comb = hc_pre(x_NKnD, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, **hc)
        x_NKnD = hc_post(self.attn(self.attn_norm(h), ctx, kv_ctx_TE), x_NKnD, post, comb)
        h, post, comb = hc_pre(x_NKnD, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, **hc)
        h = self.ffn_norm(h)
        y_TD, aux = self.ffn(h.reshape(-1, h.shape[-1]))
        return hc_post(y_TD.view_as(h), x_NKnD, post, comb), aux


@register_draft("dsv4")
class DSV4Draft(FrozenTargetDraft):
    """The drafter contract of draft_model/model.py (forward -> DraftOutput, draft_block, head_w2) around
    DeepSeek-V4's drafter stages."""

    def __init__(self, cfg: DraftConfig, embed_weight_VD: torch.Tensor, lm_head_weight_VD: torch.Tensor) -> None:
        super().__init__(embed_weight_VD, lm_head_weight_VD)
        self.cfg = cfg = resolve_cfg(cfg, embed_weight_VD, lm_head_weight_VD)
        if cfg.arch != "dsv4":  # resolve_cfg validated the dsv4 forms only if the arch says so
            raise ValueError(f"DSV4Draft needs draft.arch='dsv4', got {cfg.arch!r}")
        if cfg.mask_token_id < 0:
            raise ValueError("arch 'dsv4' fills the block with the frozen embedding of draft.mask_token_id (the "
                             "launcher chooses it from the target's tokenizer when it is -1; a draft built directly "
                             "must name it)")
        D, n = cfg.hidden_size, cfg.mhc_streams
        self.main_proj = nn.Linear(len(cfg.target_layers) * D, D, bias=False)
        self.main_norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DSV4Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(D, eps=cfg.rms_norm_eps)
        self.hc_head = HCHead(n, D, cfg.rms_norm_eps, cfg.dsv4.hc_eps)
        self.head = MarkovHead(cfg.vocab_size, cfg.head_rank) if cfg.head == "markov" else None
        conf_in = D + (cfg.head_rank if self.head is not None else 0)
        self.conf_proj = nn.Linear(conf_in, 1, bias=False) if cfg.confidence else None

    def head_w2(self) -> torch.Tensor | None:
        """[R, V] trainable second factor of the Markov head (None without one)."""
        return self.head.w2_RV if self.head is not None else None

    def pre_norm_hidden(self, batch: BlockBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hc_head output [N, K, D] before the final norm, summed MoE aux loss)."""
        cfg = self.cfg
        if batch.ctx_feats_TF.shape[1] != self.main_proj.in_features:
            raise ValueError(f"BlockBatch.ctx_feats has width {batch.ctx_feats_TF.shape[1]}, but the draft expects "
                             f"{self.main_proj.in_features} = {len(cfg.target_layers)} target layers x hidden "
                             f"{cfg.hidden_size}")
        if batch.block_size != cfg.block_size:
            raise ValueError(f"BlockBatch has block size {batch.block_size}, the draft was built for {cfg.block_size}")
        dtype = self.main_proj.weight.dtype
        ctx = DSV4Context(batch, cfg, self.main_norm(self.main_proj(batch.ctx_feats_TF.to(dtype))))
        embed_VD = self.frozen_embed_VD
        ids_NK = torch.full((batch.num_blocks, cfg.block_size), cfg.mask_token_id, dtype=torch.long,
                            device=embed_VD.device)
        ids_NK[:, 0] = batch.anchor_ids_N()
        x = embed_VD[ids_NK].to(dtype)
        x = x[..., None, :].expand(*x.shape[:-1], cfg.mhc_streams, x.shape[-1]).contiguous()
        aux = x.new_zeros(())
        for layer in self.layers:
            x, layer_aux = layer(x, ctx)
            aux = aux + layer_aux
        return self.hc_head(x), aux

    def confidence_logit(self, pre_norm_D: torch.Tensor, prev_embed_R: torch.Tensor | None) -> torch.Tensor:
        """c_k logit from [h_pre_k; W1[x_{k-1}]] (h_pre: the hidden state before the final norm)."""
        if self.conf_proj is None:
            raise ValueError("this draft was built with confidence=False")
        feats = pre_norm_D if self.head is None else torch.cat([pre_norm_D, prev_embed_R.to(pre_norm_D.dtype)], -1)
        return self.conf_proj(feats).squeeze(-1)

    def forward(self, batch: BlockBatch) -> DraftOutput:
        """Training forward; the Markov head is teacher-forced with the batch's true previous tokens."""
        pre_NKD, aux = self.pre_norm_hidden(batch)
        factor_NKR = prev_embed_NKR = None
        if self.head is not None:
            factor_NKR, prev_embed_NKR = self.head.teacher_forced(pre_NKD, batch.prev_tokens_NK())
        conf_NK = self.confidence_logit(pre_NKD, prev_embed_NKR) if self.conf_proj is not None else None
        return DraftOutput(self.norm(pre_NKD), factor_NKR, conf_NK, aux)

    @torch.no_grad()
    def draft_block(self, batch: BlockBatch, temperature: float, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inference, the drafter contract (DraftModel.draft_block): every block left to right, the Markov head
        reading the sampled tokens."""
        lm_VD = self.frozen_lm_head_VD
        pre_NKD, _ = self.pre_norm_hidden(batch)
        base_NKV = self.norm(pre_NKD).to(lm_VD.dtype) @ lm_VD.t()
        return self.sample_with_head(base_NKV, pre_NKD, batch, temperature, generator)  # heads read the pre-norm state


# ---- names in the engines' formats --------------------------------------------------------------------------------

# ours (per stage, after "layers.<i>.") -> llama.cpp GGUF (after "blk.<i>."), DeepSeek-V4 checkpoint (after
# "mtp.<i>."); experts "e" expand per expert in the DeepSeek layout
STAGE_NAMES = {
    "attn_norm.weight": ("attn_norm.weight", "attn_norm.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "ffn_norm.weight"),
    "hc_attn_fn": ("hc_attn_fn.weight", "hc_attn_fn"),
    "hc_attn_base": ("hc_attn_base.weight", "hc_attn_base"),
    "hc_attn_scale": ("hc_attn_scale.weight", "hc_attn_scale"),
    "hc_ffn_fn": ("hc_ffn_fn.weight", "hc_ffn_fn"),
    "hc_ffn_base": ("hc_ffn_base.weight", "hc_ffn_base"),
    "hc_ffn_scale": ("hc_ffn_scale.weight", "hc_ffn_scale"),
    "attn.wq_a.weight": ("attn_q_a.weight", "attn.wq_a.weight"),
    "attn.q_norm.weight": ("attn_q_a_norm.weight", "attn.q_norm.weight"),
    "attn.wq_b.weight": ("attn_q_b.weight", "attn.wq_b.weight"),
    "attn.wkv.weight": ("attn_kv.weight", "attn.wkv.weight"),
    "attn.kv_norm.weight": ("attn_kv_a_norm.weight", "attn.kv_norm.weight"),
    "attn.wo_a.weight": ("attn_output_a.weight", "attn.wo_a.weight"),  # [G*Ro, H*E/G]; GGUF reshapes to 3-D
    "attn.wo_b.weight": ("attn_output_b.weight", "attn.wo_b.weight"),
    "attn.attn_sink": ("attn_sinks.weight", "attn.attn_sink"),
    "ffn.router_ED": ("ffn_gate_inp.weight", "ffn.gate.weight"),
    "ffn.router_bias_E": ("exp_probs_b.bias", "ffn.gate.bias"),
    "ffn.w_gate_EDI": ("ffn_gate_exps.weight", "ffn.experts.{e}.w1.weight"),  # transpose(-1, -2): [E, I, D]
    "ffn.w_up_EDI": ("ffn_up_exps.weight", "ffn.experts.{e}.w3.weight"),  # transpose(-1, -2): [E, I, D]
    "ffn.w_down_EID": ("ffn_down_exps.weight", "ffn.experts.{e}.w2.weight"),  # transpose(-1, -2): [E, D, I]
    "ffn.shared.gate_proj.weight": ("ffn_gate_shexp.weight", "ffn.shared_experts.w1.weight"),
    "ffn.shared.up_proj.weight": ("ffn_up_shexp.weight", "ffn.shared_experts.w3.weight"),
    "ffn.shared.down_proj.weight": ("ffn_down_shexp.weight", "ffn.shared_experts.w2.weight"),
}
# whole-draft tensors: ours -> (GGUF, DeepSeek; DeepSeek keeps them under the first (main_*) or last stage)
ROOT_NAMES = {
    "main_proj.weight": ("fc.weight", "main_proj.weight"),
    "main_norm.weight": ("enc.output_norm.weight", "main_norm.weight"),
    "norm.weight": ("output_norm.weight", "norm.weight"),
    "hc_head.fn": ("output_hc_fn.weight", "hc_head_fn"),
    "hc_head.base": ("output_hc_base.weight", "hc_head_base"),
    "hc_head.scale": ("output_hc_scale.weight", "hc_head_scale"),
    "head.w1.weight": ("markov_w1.weight", "markov_head.markov_w1.weight"),
    "head.w2_RV": ("markov_w2.weight", "markov_head.markov_w2.weight"),  # transposed: [V, R]
    "conf_proj.weight": ("conf_proj.weight", "confidence_head.proj.weight"),
}
TRANSPOSED = ("ffn.w_gate_EDI", "ffn.w_up_EDI", "ffn.w_down_EID", "head.w2_RV")


def export_state(state: dict[str, torch.Tensor], fmt: str, num_layers: int) -> dict[str, torch.Tensor]:
    """A DSV4Draft state_dict in llama.cpp's GGUF tensor names (`fmt="gguf"`, torch layout: the writer reverses
    the dims into ggml's) or in the DeepSeek-V4 checkpoint's `mtp.<stage>.` names (`fmt="deepseek"`, one tensor
    per routed expert). Names and shapes only: no dtype change."""
    if fmt not in ("gguf", "deepseek"):
        raise ValueError(f"fmt must be 'gguf' or 'deepseek', got {fmt!r}")
    col = 0 if fmt == "gguf" else 1
    out: dict[str, torch.Tensor] = {}

    def put(ours: str, theirs: str, t: torch.Tensor) -> None:
        if ours in TRANSPOSED:
            t = t.transpose(-1, -2)
        if "{e}" in theirs:
            for e in range(t.shape[0]):
                out[theirs.format(e=e)] = t[e].contiguous()
        else:
            out[theirs] = t.contiguous()

    for name, t in state.items():
        if name in ROOT_NAMES:
            stage = 0 if name.startswith("main_") else num_layers - 1
            theirs = ROOT_NAMES[name][col]
            put(name, theirs if fmt == "gguf" else f"mtp.{stage}.{theirs}", t)
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            if rest not in STAGE_NAMES:
                raise KeyError(f"no engine name for {name}")
            theirs = STAGE_NAMES[rest][col]
            put(rest, f"blk.{i}.{theirs}" if fmt == "gguf" else f"mtp.{i}.{theirs}", t)
        else:
            raise KeyError(f"no engine name for {name}")
    return out
