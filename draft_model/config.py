"""Typed configuration of a draft model (the `draft` section of the run config tree).

Pure dataclasses: no torch, no I/O. The strict YAML/CLI loading lives in pipeline/config.py; this module only
states the fields, their defaults and the invariants between them (`validate`).

Conventions:
- `target_layers` index the target's hidden states the way Hugging Face `output_hidden_states` does
  (0 = embedding output, i = output of decoder layer i); the special value -1 means the target's final
  pre-LM-head hidden state (post final norm: exactly what the LM head multiplies).
- `hidden_size` must equal the target's hidden size: the draft reuses the target's frozen embedding and LM head.
- Every field's allowed values are stated once, in its class's `RANGES` table (a `Range` per field), and checked by
  `check_ranges` (the run config's sections in pipeline/config.py use the same two); `validate` adds the checks
  between fields.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

FINAL_HIDDEN = -1  # marker in DraftConfig.target_layers: the target's pre-LM-head state


@dataclass(frozen=True)
class Range:
    """The values one config field allows. A number must be finite and within [lo, hi] (either end open or absent),
    or one of `also` (special values such as -1 = no limit, explained by `note`); `choices` lists every allowed
    value instead (a callable: computed when checked). A list field states `length` or `nonempty` and its items
    obey the rest; a mapping's values do; a string with `nonempty` must not be empty. `free` = anything of the
    field's type (the type itself is checked when the config is built)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple | Callable[[], Sequence] | None = None
    also: tuple = ()
    note: str = ""
    length: int | None = None
    nonempty: bool = False
    free: bool = False

    def _choices(self) -> tuple:
        return tuple(self.choices() if callable(self.choices) else self.choices)

    def allows_item(self, v: Any) -> bool:
        if self.free or v in self.also:
            return True
        if self.choices is not None:
            return v in self._choices()
        if isinstance(v, str):
            return bool(v) or not self.nonempty
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            return False
        lo_ok = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        return lo_ok and (self.hi is None or (v < self.hi if self.hi_open else v <= self.hi))

    def allows(self, value: Any) -> bool:
        if isinstance(value, list):
            if (self.length is not None and len(value) != self.length) or (self.nonempty and not value):
                return False
            return all(self.allows_item(v) for v in value)
        if isinstance(value, dict):
            return all(self.allows_item(v) for v in value.values())
        return self.allows_item(value)

    def describe(self, shape: str = "") -> str:
        """The allowed values in words, as the refusal quotes them: '>= 1', 'in [0, 1)', 'one of [...]'; `shape`
        "list" or "dict" words it for a list field's items or a mapping's values."""
        if self.choices is not None:
            text = f"one of {list(self._choices())}"
        elif self.lo is not None and self.hi is not None:
            text = f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            text = "a non-empty string" if self.nonempty else "anything"
        if self.also:
            text += f", or {' or '.join(map(str, self.also))}" + (f" ({self.note})" if self.note else "")
        elif self.note:
            text += f" ({self.note})"
        if shape == "list":
            count = f"{self.length} values" if self.length is not None else (
                "a non-empty list" if self.nonempty else "a list")
            return f"{count}, each {text}"
        if shape == "dict":
            return f"a mapping whose values are each {text}"
        return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def at_least(lo: float, **kw: Any) -> Range:
    return Range(lo=lo, **kw)


def above(lo: float, **kw: Any) -> Range:
    return Range(lo=lo, lo_open=True, **kw)


def one_of(*choices: Any, **kw: Any) -> Range:
    return Range(choices=choices, **kw)


TEXT = Range(nonempty=True)  # a non-empty string
FREE = Range(free=True)  # any value of the field's type
SEED = Range(lo=0, hi=2**32 - 1)  # numpy's generators want >= 0; 32 bits seed every RNG we use (numpy, torch)


def check_ranges(cfg: Any, where: str) -> None:
    """ValueError naming the key and its allowed values for the first field of `cfg` (a config dataclass) outside
    its `RANGES` entry. Nested config dataclasses and booleans are left to their own checks; a field without an
    entry is a bug (tests/test_config.py holds every config class to a complete table)."""
    table = type(cfg).RANGES
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if is_dataclass(value) or isinstance(value, bool):
            continue
        spec = table[f.name]
        if not spec.allows(value):
            shape = "list" if isinstance(value, list) else "dict" if isinstance(value, dict) else ""
            raise ValueError(f"{where}.{f.name} must be {spec.describe(shape)}, got {value!r}")


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
    score_func: str = "sigmoid"  # "sigmoid" (DeepSeek-V3), "softmax" or "sqrtsoftplus" (DeepSeek-V4)
    # the routed experts' weights (renormalised over the top-k for sigmoid/sqrtsoftplus) times this factor
    # (DeepSeek's routed_scaling_factor; llama.cpp's expert_weights_scale); 1 = unscaled
    routed_scaling_factor: float = 1.0
    # DeepSeek-V4's SwiGLU clamp, in every expert (routed and shared): silu(min(gate, L)) * clamp(up, -L, L);
    # 0 = no clamp (DeepSeek-V4 uses 10)
    swiglu_limit: float = 0.0

    RANGES: ClassVar[dict[str, Range]] = {
        "num_experts": at_least(1), "top_k": at_least(1), "num_shared_experts": at_least(0),
        "expert_intermediate_size": at_least(1), "bias_update_rate": at_least(0), "aux_loss_coef": at_least(0),
        "score_func": one_of("sigmoid", "softmax", "sqrtsoftplus"), "routed_scaling_factor": above(0),
        "swiglu_limit": at_least(0, note="0 = no clamp"),
    }

    def validate(self, where: str = "draft.moe") -> None:
        check_ranges(self, where)
        if self.top_k > self.num_experts:
            raise ValueError(f"{where}.top_k ({self.top_k}) must be <= {where}.num_experts ({self.num_experts})")


@dataclass
class DSV4Config:
    """The dimensions of DeepSeek-V4's drafter block that no other architecture has (arch "dsv4",
    draft_model/dsv4.py); its other dimensions are the DraftConfig's own (num_heads, head_dim, mhc_*, moe,
    sliding_window, rope_theta, rms_norm_eps). Names are DeepSeek-V4's config keys."""

    q_lora_rank: int = 256  # queries: D -> q_lora_rank -> RMSNorm -> num_heads x head_dim
    rope_head_dim: int = 64  # qk_rope_head_dim: RoPE on the trailing dims of each head
    o_groups: int = 2  # the output LoRA: heads in o_groups groups, each group -> o_lora_rank, then -> D
    o_lora_rank: int = 256
    hc_eps: float = 1e-6  # added to the hyper-connections' pre weights and inside Sinkhorn

    RANGES: ClassVar[dict[str, Range]] = {
        "q_lora_rank": at_least(1), "rope_head_dim": at_least(2), "o_groups": at_least(1),
        "o_lora_rank": at_least(1), "hc_eps": at_least(0),
    }

    def validate(self, where: str = "draft.dsv4") -> None:
        check_ranges(self, where)
        if self.rope_head_dim % 2:
            raise ValueError(f"{where}.rope_head_dim must be even (RoPE rotates pairs), got {self.rope_head_dim}")


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
    # "packed" (flex attention on CUDA, grouped SDPA elsewhere: attention.py) | "flex" (flex attention on any device;
    # no backward on a CPU) | "gather" (the per-block reference)
    attn_impl: str = "packed"
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
    # which slot predicts what (docs/vllm-serving.md): "anchor" = γ slots [anchor, MASK x γ-1], slot k predicts the
    # token after anchor + k (DSpark's sample_from_anchor); "bonus_anchor" = γ+1 slots [anchor, MASK x γ], slot 0
    # predicts nothing and slot k >= 1 the token at anchor + k: the 1+N query block vLLM's DFlash proposer feeds
    # (vllm/v1/spec_decode/dflash.py). Both predict the same γ tokens from the same context; arch "dspark" only.
    block_layout: str = "anchor"
    dsv4: DSV4Config = field(default_factory=DSV4Config)  # arch "dsv4" only

    RANGES: ClassVar[dict[str, Range]] = {
        "arch": Range(nonempty=True, note="a name in draft_model.registry; RunConfig.validate checks it"),
        "vocab_size": at_least(0, note="0 = the target's"),
        "hidden_size": at_least(0, note="0 = the target's"),
        "target_layers": at_least(0, also=(FINAL_HIDDEN,), note="the final pre-LM-head state", nonempty=True),
        "block_size": at_least(1), "num_layers": at_least(1), "num_heads": at_least(1), "num_kv_heads": at_least(1),
        "head_dim": at_least(0, note="0 = hidden_size // num_heads"),
        "intermediate_size": at_least(0, note="0 = 4 * hidden_size"), "ffn": one_of("dense", "moe"),
        "residual": one_of("plain", "mhc"), "mhc_streams": at_least(1), "mhc_sinkhorn_iters": at_least(1),
        "sliding_window": at_least(0, note="0 = all"), "attn_impl": one_of("packed", "flex", "gather"),
        "head": one_of("none", "markov", "rnn"), "head_rank": at_least(1), "rnn_state_size": at_least(1),
        "rope_theta": above(0), "rms_norm_eps": above(0), "mask": one_of("learned", "token"),
        "mask_token_id": at_least(0, also=(-1,), note="chosen at launch"),
        "block_layout": one_of("anchor", "bonus_anchor"),
    }

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def resolved_intermediate_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def validate(self) -> None:
        check_ranges(self, "draft")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.hidden_size and not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"draft.hidden_size ({self.hidden_size}) not divisible by num_heads ({self.num_heads}); "
                             "set draft.head_dim")
        self.moe.validate()  # its ranges hold whether or not ffn=moe uses it
        if self.vocab_size and self.mask_token_id >= self.vocab_size:
            raise ValueError(f"draft.mask_token_id must be -1 (chosen at launch) or a token id in "
                             f"0..{self.vocab_size - 1}, got {self.mask_token_id}")
        if self.mask == "token" and self.arch not in ("dspark", "dsv4"):
            raise ValueError(f"draft.mask='token' is the block mask slot of arch 'dspark'; draft.arch={self.arch!r} "
                             "has no mask slots (use draft.mask=learned)")
        if self.block_layout != "anchor" and self.arch != "dspark":
            raise ValueError(f"draft.block_layout={self.block_layout!r} is a block layout of arch 'dspark'; "
                             f"draft.arch={self.arch!r} drafts in its own layout (use draft.block_layout=anchor)")
        self.dsv4.validate()
        if self.arch == "dsv4":
            self._validate_dsv4()
        self._validate_baselines()

    def _validate_dsv4(self) -> None:
        """The forms DeepSeek-V4's drafter block fixes (draft_model/dsv4.py; llama.cpp refuses or asserts the
        others), one line each."""
        wanted = {"ffn": "moe", "residual": "mhc", "mask": "token", "num_kv_heads": 1, "mhc_streams": 4}
        for name, want in wanted.items():
            if getattr(self, name) != want:
                raise ValueError(f"draft.arch='dsv4' (DeepSeek-V4's drafter block) needs draft.{name}={want!r}, got "
                                 f"{getattr(self, name)!r}")
        if self.moe.score_func != "sqrtsoftplus":
            raise ValueError("draft.arch='dsv4' needs draft.moe.score_func='sqrtsoftplus' (DeepSeek-V4's router; "
                             f"llama.cpp refuses any other), got {self.moe.score_func!r}")
        if self.sliding_window <= 0:
            raise ValueError("draft.arch='dsv4' needs draft.sliding_window > 0: every DeepSeek-V4 drafter stage "
                             "attends a sliding window")
        if self.head not in ("none", "markov"):
            raise ValueError(f"draft.arch='dsv4' has a Markov head or none, got draft.head={self.head!r}")
        if FINAL_HIDDEN in self.target_layers:
            raise ValueError("draft.arch='dsv4' reads target layer inputs (hidden-state indices 0..L-1, what "
                             "llama.cpp's targets expose), not the final state -1; got draft.target_layers="
                             f"{self.target_layers}")
        d = self.dsv4
        E = self.head_dim or (self.hidden_size // self.num_heads if self.hidden_size else 0)
        if E and (E % 2 or d.rope_head_dim > E):
            raise ValueError(f"draft.dsv4.rope_head_dim ({d.rope_head_dim}) must be at most the head dim ({E}), "
                             "which must be even")
        if self.num_heads % d.o_groups:
            raise ValueError(f"draft.num_heads ({self.num_heads}) must be a multiple of draft.dsv4.o_groups "
                             f"({d.o_groups})")

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
            if self.arch == "dsv4" and layer == num_target_layers:
                raise ValueError(f"draft.target_layers has {layer}, the target's last hidden state; arch 'dsv4' reads "
                                 f"layer inputs 0..{num_target_layers - 1}, the ones llama.cpp's targets expose")

    def resolved_for_target(self, vocab_size: int, hidden_size: int, num_target_layers: int) -> DraftConfig:
        """A copy with vocab/hidden size filled in from the target, checked against it."""
        self.check_target(vocab_size, hidden_size, num_target_layers)
        out = DraftConfig(**{**asdict(self), "moe": MoEConfig(**asdict(self.moe)),
                             "dsv4": DSV4Config(**asdict(self.dsv4))})
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
    # stay fp64). bfloat16: faster matmuls on a CPU with AMX or AVX512-BF16 and on tensor-core GPUs, one more (bf16)
    # chunk buffer beside the fp32 ones, logits to bf16 precision; no measurable acceptance cost
    # (docs/design-notes.md). On any other CPU bf16 is emulated and many times slower than float32. auto (the
    # default): bfloat16 where the trainer's device multiplies bf16 natively, else float32
    # (draft_model/precision.py); the trainer resolves it once and saves the choice, which a resume keeps
    matmul_dtype: str = "auto"

    RANGES: ClassVar[dict[str, Range]] = {
        "ce_weight": at_least(0), "tv_weight": at_least(0), "conf_weight": at_least(0), "decay_lambda": above(0),
        "chunk_rows": at_least(1), "matmul_dtype": one_of("auto", "float32", "bfloat16"),
    }

    def validate(self) -> None:
        check_ranges(self, "loss")
        if self.ce_weight == self.tv_weight == self.conf_weight == 0:
            raise ValueError("loss.ce_weight, loss.tv_weight and loss.conf_weight are all 0: nothing would train; "
                             "give at least one a weight > 0")


def evenly_spaced_layers(num_target_layers: int, count: int) -> list[int]:
    """DFlash's default context layers: `count` layers evenly spaced from 1 to L-3 (HF hidden-state indices)."""
    lo, hi = 1, max(1, num_target_layers - 3)
    if count == 1:
        return [hi]
    return [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
