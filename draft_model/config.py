"""Typed configuration of a draft model (the `draft` section of the run config tree).

Pure dataclasses: no torch, no I/O. The strict YAML/CLI loading lives in pipeline/config.py; this module only
states the fields, their defaults and the invariants between them (`validate`).

Conventions:
- `target_layers` index the target's hidden states the way Hugging Face `output_hidden_states` does
  (0 = embedding output, i = output of decoder layer i); the special value -1 means the target's final
  pre-LM-head hidden state (post final norm: exactly what the LM head multiplies).
- `hidden_size` must equal the target's hidden size: the draft reuses the target's frozen embedding and LM head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FINAL_HIDDEN = -1  # marker in DraftConfig.target_layers: the target's pre-LM-head state


@dataclass
class MoEConfig:
    """DeepSeek-style MoE FFN: top-k routed experts plus always-on shared experts.

    Load balancing: auxiliary-loss-free router bias (DeepSeek-V3): a per-expert bias added to the routing
    scores for selection only, nudged by `bias_update_rate` toward equal load after each training forward.
    `aux_loss_coef` > 0 additionally adds the classic sequence-level balance loss (off by default).
    """

    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    expert_intermediate_size: int = 256
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0
    score_func: str = "sigmoid"  # "sigmoid" (DeepSeek-V3) or "softmax"

    def validate(self) -> None:
        if self.num_experts < 1 or not (1 <= self.top_k <= self.num_experts):
            raise ValueError(f"moe: need 1 <= top_k <= num_experts, got top_k={self.top_k}, "
                             f"num_experts={self.num_experts}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"moe.score_func must be 'sigmoid' or 'softmax', got {self.score_func!r}")


@dataclass
class DraftConfig:
    arch: str = "dspark"  # name in draft_model.registry
    vocab_size: int = 0  # 0 = take from the target at build time
    hidden_size: int = 0  # 0 = take from the target at build time; must equal the target's
    target_layers: list[int] = field(default_factory=lambda: [FINAL_HIDDEN])
    # eagle3 only: False = the one target layer enters the draft's feature norm as is, with no W_fuse Linear
    # before it (DeepSeek-V3's MTP input: proj([norm(embed(x_{t+1})); norm(h_t)])); True = W_fuse first (EAGLE-3)
    fuse_features: bool = True
    block_size: int = 5  # γ: anchor + γ-1 mask tokens, γ predictions
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 0  # 0 = hidden_size // num_heads
    intermediate_size: int = 0  # dense FFN width; 0 = 4 * hidden_size
    ffn: str = "dense"  # "dense" | "moe"
    moe: MoEConfig = field(default_factory=MoEConfig)
    residual: str = "plain"  # "plain" | "mhc"
    mhc_streams: int = 4  # n residual streams for mHC
    mhc_sinkhorn_iters: int = 20
    sliding_window: int = 0  # context tokens before the anchor a block may see; 0 = all
    attn_impl: str = "packed"  # "packed" (grouped context, attention.py) | "gather" (the per-block reference)
    head: str = "markov"  # sequential head: "none" | "markov" | "rnn"
    head_rank: int = 256  # r of the low-rank V x V transition (Markov) / bias projection (RNN)
    rnn_state_size: int = 256
    confidence: bool = True  # confidence head c_k = sigmoid(w^T [h_k; W1[x_{k-1}]])
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # the two forms every serving engine's DFlash/DSpark layer implements (docs/serving-export.md); both off here so
    # configs written before them rebuild the same model; the servable presets turn them on
    qk_norm: bool = False  # per-head RMSNorm on queries and on every key (context and block) before RoPE (Qwen3)
    mask: str = "learned"  # block slots 1..γ-1: "learned" (a trained vector) | "token" (the frozen target
    #                        embedding row of mask_token_id)
    mask_token_id: int = -1  # mask="token": a target token id the data never holds; -1 = chosen at launch from the
    #                          target's tokenizer and chat template (pipeline/mask_token.py)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def resolved_intermediate_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"draft.block_size must be >= 1, got {self.block_size}")
        if self.ffn not in ("dense", "moe"):
            raise ValueError(f"draft.ffn must be 'dense' or 'moe', got {self.ffn!r}")
        if self.residual not in ("plain", "mhc"):
            raise ValueError(f"draft.residual must be 'plain' or 'mhc', got {self.residual!r}")
        if self.head not in ("none", "markov", "rnn"):
            raise ValueError(f"draft.head must be 'none', 'markov' or 'rnn', got {self.head!r}")
        if not self.target_layers:
            raise ValueError("draft.target_layers must name at least one target layer (-1 = final hidden state)")
        if self.attn_impl not in ("packed", "gather"):
            raise ValueError(f"draft.attn_impl must be 'packed' or 'gather', got {self.attn_impl!r}")
        if self.sliding_window < 0:
            raise ValueError(f"draft.sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.hidden_size and not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"draft.hidden_size ({self.hidden_size}) not divisible by num_heads ({self.num_heads}); "
                             "set draft.head_dim")
        if self.ffn == "moe":
            self.moe.validate()
        if self.mask not in ("learned", "token"):
            raise ValueError(f"draft.mask must be 'learned' or 'token', got {self.mask!r}")
        if self.mask_token_id < -1 or (self.vocab_size and self.mask_token_id >= self.vocab_size):
            raise ValueError(f"draft.mask_token_id must be -1 (chosen at launch) or a token id in "
                             f"0..{self.vocab_size - 1 if self.vocab_size else 'vocab-1'}, got {self.mask_token_id}")
        if self.mask == "token" and self.arch != "dspark":
            raise ValueError(f"draft.mask='token' is the block mask slot of arch 'dspark'; draft.arch={self.arch!r} "
                             "has no mask slots (use draft.mask=learned)")
        self._validate_baselines()

    def _validate_baselines(self) -> None:
        """The combinations the MTP-1 and draft-LM baselines allow (checked at config load, one line each)."""
        if not self.fuse_features:
            if self.arch != "eagle3":
                raise ValueError(f"draft.fuse_features=false is the eagle3 MTP input; draft.arch={self.arch!r} "
                                 "always projects its target context")
            if len(self.target_layers) != 1:
                raise ValueError(f"draft.fuse_features=false feeds one target layer straight into the feature "
                                 f"norm; got draft.target_layers={self.target_layers}")
        if self.arch == "draft-lm":
            wanted = {"head": "none", "ffn": "dense", "residual": "plain", "sliding_window": 0,
                      "target_layers": [FINAL_HIDDEN]}
            for name, want in wanted.items():
                if getattr(self, name) != want:
                    why = (" (it reads no target layer; the final state -1 travels anyway for the loss's p_t)"
                           if name == "target_layers" else "")
                    raise ValueError(f"draft.arch='draft-lm' (tokens only) needs draft.{name}={want!r}, got "
                                     f"{getattr(self, name)!r}{why}")

    def check_target(self, vocab_size: int, hidden_size: int, num_target_layers: int) -> None:
        """Raise a clear error when this draft cannot sit on the given target."""
        if self.vocab_size and self.vocab_size != vocab_size:
            raise ValueError(f"draft.vocab_size={self.vocab_size} does not match the target's vocab size "
                             f"{vocab_size}; the draft uses the target's embedding and LM head")
        if self.hidden_size and self.hidden_size != hidden_size:
            raise ValueError(f"draft.hidden_size={self.hidden_size} does not match the target's hidden size "
                             f"{hidden_size}; the draft uses the target's embedding and LM head")
        for layer in self.target_layers:
            if layer != FINAL_HIDDEN and not (0 <= layer <= num_target_layers):
                raise ValueError(f"draft.target_layers has {layer}, but the target has hidden states "
                                 f"0..{num_target_layers} (or -1 for the final pre-LM-head state)")

    def resolved_for_target(self, vocab_size: int, hidden_size: int, num_target_layers: int) -> DraftConfig:
        """A copy with vocab/hidden size filled in from the target, checked against it."""
        self.check_target(vocab_size, hidden_size, num_target_layers)
        out = DraftConfig(**{**asdict(self), "moe": MoEConfig(**asdict(self.moe))})
        out.vocab_size, out.hidden_size = vocab_size, hidden_size
        out.validate()
        return out

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LossConfig:
    """Weights of the DSpark loss L = ce * CE + tv * L1(p_d, p_t) + conf * BCE(c, c*), per-position decay."""

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    decay_lambda: float = 4.0  # w_k = exp(-(k-1)/lambda), k = 1..gamma
    chunk_rows: int = 256  # block positions whose vocabulary-sized tensors are alive at once
    # dtype of the loss's fp32 LM-head matmuls (softmaxes, CE and L1 are fp32 either way; fp64 reference inputs
    # stay fp64). bfloat16 (the default): faster matmuls on a CPU with AMX and on tensor-core GPUs, one more
    # (bf16) chunk buffer beside the fp32 ones, logits to bf16 precision; no measurable acceptance cost
    # (docs/design-notes.md). float32 on a CPU without native bf16 matmuls (no AMX / AVX512-BF16), where bf16
    # would be slower
    matmul_dtype: str = "bfloat16"

    def validate(self) -> None:
        if self.decay_lambda <= 0:
            raise ValueError(f"loss.decay_lambda must be > 0, got {self.decay_lambda}")
        if self.chunk_rows < 1:
            raise ValueError(f"loss.chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.matmul_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"loss.matmul_dtype must be float32 or bfloat16, got {self.matmul_dtype!r}")


def evenly_spaced_layers(num_target_layers: int, count: int) -> list[int]:
    """DFlash's default context layers: `count` layers evenly spaced from 1 to L-3 (HF hidden-state indices)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if count == 1:
        return [hi]
    return [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
