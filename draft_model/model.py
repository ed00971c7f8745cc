"""The DSpark draft model: parallel backbone + optional sequential head + confidence head, on the target's
frozen embedding and LM head.

The frozen target tensors are non-persistent buffers (one tensor when the target ties them), so `parameters()`
and `state_dict()` hold only what the draft trains (plus the MoE balance-bias buffers, which are draft state).
The LM head is *not* applied here: the loss and the sampler multiply `hidden_NKD` (and the head factor times
`head_w2()`) by it in vocabulary chunks, so no N*K*V tensor is formed by the forward.

Legend: N blocks, K block size γ, D hidden, V vocab, R head rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from draft_model import sampling
from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig
from draft_model.heads import SequentialHead, build_head
from draft_model.layers import DraftBackbone
from draft_model.registry import frozen_weights_dtype, register_draft


@dataclass
class DraftOutput:
    hidden_NKD: torch.Tensor  # final draft hidden per slot (post final norm) = LM-head input
    head_factor_NKR: torch.Tensor | None  # sequential-head factor a_k; bias_k = a_k @ model.head_w2()
    conf_logit_NK: torch.Tensor | None  # confidence logit (pre-sigmoid)
    aux_loss: torch.Tensor  # scalar MoE balance loss (0 when unused)


def resolve_cfg(cfg: DraftConfig, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor) -> DraftConfig:
    """`cfg` with vocab/hidden size taken from the target's embedding, checked against any values it gives."""
    if embed_VD.ndim != 2 or lm_head_VD.shape != embed_VD.shape:
        raise ValueError(f"embedding {tuple(embed_VD.shape)} and LM head {tuple(lm_head_VD.shape)} must both be "
                         "[vocab, hidden]")
    V, D = embed_VD.shape
    if cfg.vocab_size and cfg.vocab_size != V:
        raise ValueError(f"draft.vocab_size={cfg.vocab_size} but the target's embedding has vocab {V}")
    if cfg.hidden_size and cfg.hidden_size != D:
        raise ValueError(f"draft.hidden_size={cfg.hidden_size} but the target's embedding has hidden {D}")
    cfg = replace(cfg, vocab_size=V, hidden_size=D)
    cfg.validate()
    return cfg


def register_frozen_target_weights(module: nn.Module, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor) -> None:
    """The target's embedding and LM head as non-persistent buffers `frozen_embed_VD` / `frozen_lm_head_VD`:
    moved with the module, never trained, never saved in its state_dict; one tensor when the target ties them.

    They take the dtype of the draft's new parameters (torch's default dtype), whatever the target runs in, or the
    one `build_draft` was given (draft_model/registry.py): a bf16 target under an fp32 draft must not make the loss
    mix dtypes. Same dtype: no copy, the target's tensors are shared."""
    tied = lm_head_VD is embed_VD or (lm_head_VD.data_ptr() == embed_VD.data_ptr()
                                      and lm_head_VD.stride() == embed_VD.stride())
    dtype = frozen_weights_dtype() or torch.get_default_dtype()
    embed = embed_VD.detach().to(dtype)
    module.register_buffer("frozen_embed_VD", embed, persistent=False)
    module.register_buffer("frozen_lm_head_VD", embed if tied else lm_head_VD.detach().to(dtype), persistent=False)


class FrozenTargetDraft(nn.Module):
    """Base of every draft architecture: the target's frozen embedding and LM head (`register_frozen_target_weights`)
    and the accessors the loss, the trainers and the evaluator read them through."""

    def __init__(self, embed_weight_VD: torch.Tensor, lm_head_weight_VD: torch.Tensor) -> None:
        super().__init__()
        register_frozen_target_weights(self, embed_weight_VD, lm_head_weight_VD)

    def lm_head_weight(self) -> torch.Tensor:
        """[V, D] frozen target LM head."""
        return self.frozen_lm_head_VD

    def embed_weight(self) -> torch.Tensor:
        """[V, D] frozen target embedding."""
        return self.frozen_embed_VD

    def head_w2(self) -> torch.Tensor | None:
        """[R, V] trainable second factor of a sequential head; None for architectures without one."""
        return None

    def sample_with_head(self, base_NKV: torch.Tensor, head_in_NKD: torch.Tensor, batch: BlockBatch,
                         temperature: float, generator: torch.Generator | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft a block left to right from the backbone's logits `base_NKV`: the sequential head (`self.head`, may
        be None) reads `head_in_NKD` and the token sampled before each slot; the confidence head
        (`self.conf_proj`, `self.confidence_logit`) reads the same states. -> draft_block's triple."""
        embeds: list[torch.Tensor] = []
        step_fn = None
        if self.head is not None:
            w2_RV, state = self.head.w2_RV, None

            def step_fn(k: int, prev_N: torch.Tensor) -> torch.Tensor:
                nonlocal state
                factor_NR, prev_embed_NR, state = self.head.step(head_in_NKD[:, k], prev_N, state)
                embeds.append(prev_embed_NR)
                return (factor_NR @ w2_RV).to(base_NKV.dtype)

        tokens_NK, probs_NKV = sampling.sample_block(base_NKV, step_fn, batch.anchor_ids_N(), temperature, generator)
        conf_logit_NK = None
        if self.conf_proj is not None:
            conf_logit_NK = self.confidence_logit(head_in_NKD, torch.stack(embeds, dim=1) if embeds else None)
        return tokens_NK, probs_NKV, conf_logit_NK


@register_draft("dspark")
class DraftModel(FrozenTargetDraft):
    def __init__(self, cfg: DraftConfig, embed_weight_VD: torch.Tensor, lm_head_weight_VD: torch.Tensor) -> None:
        super().__init__(embed_weight_VD, lm_head_weight_VD)
        self.cfg = cfg = resolve_cfg(cfg, embed_weight_VD, lm_head_weight_VD)
        # bonus-anchor layout: the backbone runs γ+1 slots and slot 0 (the anchor's own output) is dropped
        bonus = cfg.block_layout == "bonus_anchor"
        self.backbone = DraftBackbone(replace(cfg, block_size=cfg.block_size + 1) if bonus else cfg)
        self.head: SequentialHead | None = build_head(cfg)
        conf_in = cfg.hidden_size + (cfg.head_rank if self.head is not None else 0)
        self.conf_proj = nn.Linear(conf_in, 1) if cfg.confidence else None

    def head_w2(self) -> torch.Tensor | None:
        """[R, V] trainable second factor of the sequential head (None without one)."""
        return self.head.w2_RV if self.head is not None else None

    def backbone_hidden(self, batch: BlockBatch) -> torch.Tensor:
        """[N, K, D] LM-head input of every slot (inference: the heads then run left to right)."""
        return self.run_backbone(batch)[0]

    def run_backbone(self, batch: BlockBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden_NKD of the γ predicting slots, MoE aux loss), in either block layout."""
        if self.cfg.block_layout == "anchor":
            return self.backbone(batch, self.frozen_embed_VD)
        hidden_NKD, aux = self.backbone(batch.with_anchor_slot(), self.frozen_embed_VD)
        return hidden_NKD[:, 1:], aux

    def confidence_logit(self, hidden_D: torch.Tensor, prev_embed_R: torch.Tensor | None) -> torch.Tensor:
        """c_k logit from [h_k; W1[x_{k-1}]] (just h_k without a sequential head); any leading shape."""
        if self.conf_proj is None:
            raise ValueError("this draft was built with confidence=False")
        feats = hidden_D if self.head is None else torch.cat([hidden_D, prev_embed_R.to(hidden_D.dtype)], dim=-1)
        return self.conf_proj(feats).squeeze(-1)

    def forward(self, batch: BlockBatch) -> DraftOutput:
        """Training forward; the heads are teacher-forced with the batch's true previous tokens."""
        hidden_NKD, aux = self.run_backbone(batch)
        factor_NKR = prev_embed_NKR = None
        if self.head is not None:
            factor_NKR, prev_embed_NKR = self.head.teacher_forced(hidden_NKD, batch.prev_tokens_NK())
        conf_NK = self.confidence_logit(hidden_NKD, prev_embed_NKR) if self.conf_proj is not None else None
        return DraftOutput(hidden_NKD, factor_NKR, conf_NK, aux)

    @torch.no_grad()
    def draft_block(self, batch: BlockBatch, temperature: float, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Inference, the drafter contract every architecture implements (Eagle3Draft.draft_block too): draft
        every block of `batch` left to right, the sequential head reading the sampled tokens. Only the batch's
        context and anchors are read. -> (tokens_NK int64, probs_NKV fp32: the distributions the tokens were
        drawn from at `temperature`, one-hot when greedy; conf_logit_NK: raw pre-sigmoid confidence logits, None
        without a confidence head)."""
        lm_VD = self.frozen_lm_head_VD
        hidden_NKD = self.backbone_hidden(batch)
        base_NKV = hidden_NKD.to(lm_VD.dtype) @ lm_VD.t()
        return self.sample_with_head(base_NKV, hidden_NKD, batch, temperature, generator)
