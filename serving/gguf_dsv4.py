"""A DeepSeek-V4-style DSpark draft as the GGUF llama.cpp b11434 loads on its DFLASH arch's DSV4 path.

llama.cpp's converter reaches that path only from a DeepseekV4ForCausalLM checkpoint with MXFP4 routed experts
(`convert_hf_to_gguf.py --dspark`, conversion/deepseek.py:929-1034), which would quantize a trained draft; this
module writes the same file directly with the `gguf` package, every tensor F32 (or F16 for matrices).

Input: the draft's tensors under llama.cpp's own GGUF names (`blk.<stage>.attn_q_a.weight`, ...; `dsv4_shapes`
lists every name with its shape), so the file is a copy of them; `from_deepseek_names` renames DeepSeek's
`mtp.<stage>.*` checkpoint tensors onto these (conversion/deepseek.py:813-876, 929-1010; docs/serving.md,
"DeepSeek-V4 drafter GGUF"). Shapes are in array order: llama.cpp's `ne` reversed, which is PyTorch's
`nn.Linear.weight` shape ([out, in]). Plus the hyper-parameters (`DSV4DraftConfig`) and the target's facts
(`TargetFacts`, read from the target's GGUF: hidden size, layer count, architecture and the tokenizer, which the
draft must carry for llama.cpp's vocabulary check, common/speculative.cpp:106-150).

The GGUF is selected as the DSV4 graph by `dflash.hyper_connection.count > 0` (src/models/dflash.cpp:53-54,
1041-1043) and as `draft-dspark` by the presence of `markov_w1.weight` (common/speculative.cpp:2378-2381). Every
required key and tensor, with the file:line that requires it, is in docs/serving.md and `dsv4_shapes`.

Legend: D hidden size, H heads, E head dim, R rope dims, Q q-LoRA rank, G output groups, O output-LoRA rank,
X experts, I expert FFN width, S shared experts, C = 4 hyper-connection streams, V vocabulary, r Markov rank,
T number of target layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from draft_model.dsv4 import ROOT_NAMES, STAGE_NAMES

ARCH = "dflash"
SQRT_SOFTPLUS = 4  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (src/llama-hparams.h:21); the only one allowed
# targets whose graph also exposes the state after the last layer as target layer n_layer
# (src/models/deepseek4.cpp:1330, mimo2.cpp:238, nemotron-h.cpp:238); LLaMA/Qwen3 expose layer inputs only
# (src/models/llama.cpp:127), and asking for n_layer aborts (src/llama-graph.cpp:1413)
FINAL_STATE_ARCHS = ("deepseek4", "mimo2", "nemotron_h", "nemotron_h_moe")
# tensors written in F32 whatever the dtype: norms, biases, sinks, the hyper-connection parameters, and the grouped
# output LoRA, whose F16 product with the permuted attention output has no CPU kernel in b11434 (the draft aborts
# with GGML_ASSERT(*cur_backend_id != -1), ggml/src/ggml-backend.cpp:1434)
_ALWAYS_F32 = ("norm", "bias", "sinks", "hc_", "attn_output_a")


@dataclass(frozen=True)
class DSV4DraftConfig:
    """The drafter block's hyper-parameters (DeepSeek-V4 config names where one exists)."""

    hidden_size: int            # D, must equal the target's
    num_layers: int             # drafter stages (DeepSeek's mtp.<stage>)
    num_heads: int              # H query heads; one shared K=V head (MQA)
    head_dim: int               # E
    qk_rope_head_dim: int       # R: the trailing R dims of each head are rotated (GPT-J pairs)
    q_lora_rank: int            # Q
    o_groups: int               # G
    o_lora_rank: int            # O
    sliding_window: int         # every stage is SWA with this window
    num_experts: int            # X
    num_experts_per_tok: int    # top-k
    moe_intermediate_size: int  # I
    num_shared_experts: int     # S
    block_size: int             # γ: llama.cpp drafts at most γ tokens per round
    target_layers: tuple[int, ...]  # llama.cpp's index = the HF hidden-state index (input of layer k)
    mask_token_id: int          # the mask slot is the target's embedding row of this token
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float = 0.0   # clamp of the SwiGLU; 0 disables it (src/llama-graph.cpp:2276-2280)
    hc_mult: int = 4            # C; llama.cpp asserts 4 (src/models/deepseek4.cpp:366)
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    context_length: int = 8192  # required by the loader (src/llama-model.cpp:1323)
    sample_from_anchor: bool = True  # slot k predicts the token after anchor + k


@dataclass(frozen=True)
class TargetFacts:
    """What the draft needs from the target: width, depth, architecture and the tokenizer key/values."""

    arch: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    tokenizer: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] = field(repr=False)

    @classmethod
    def from_gguf(cls, path: str | Path) -> TargetFacts:
        r = gguf.GGUFReader(str(path))
        arch = r.fields["general.architecture"].contents()
        tok = {}
        for key, f in r.fields.items():
            if key.startswith("tokenizer.") and key != "tokenizer.ggml.mask_token_id":
                vtype = f.types[0]
                sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
                tok[key] = (f.contents(), vtype, sub)
        if "tokenizer.ggml.tokens" not in tok:
            raise ValueError(f"{path}: no tokenizer.ggml.tokens; the draft must carry the target's vocabulary")
        return cls(arch=arch, hidden_size=int(r.fields[f"{arch}.embedding_length"].contents()),
                   num_layers=int(r.fields[f"{arch}.block_count"].contents()),
                   vocab_size=len(tok["tokenizer.ggml.tokens"][0]), tokenizer=tok)


def dsv4_shapes(cfg: DSV4DraftConfig, vocab_size: int, markov_rank: int | None = None,
                confidence: bool = True) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{GGUF tensor name: (array shape, required)} that llama.cpp's DSV4 loader creates
    (src/models/dflash.cpp:113-219); a GGUF with any other tensor is refused ("wrong number of tensors",
    src/llama-model-loader.cpp:1398)."""
    D, H, E, Q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    G, O, X, I, S, C = cfg.o_groups, cfg.o_lora_rank, cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.num_shared_experts, cfg.hc_mult
    V, T, mix = vocab_size, len(cfg.target_layers), (2 + C) * C
    s = {
        "fc.weight": ((D, T * D), True),              # dflash.cpp:162
        "enc.output_norm.weight": ((D,), True),       # :164
        "output_norm.weight": ((D,), True),           # :165
        "token_embd.weight": ((V, D), False),         # :113; absent: the target's (ctx_other, :917-925)
        "output.weight": ((V, D), False),             # :169; absent: the target's LM head (:1013-1021)
        "output_hc_fn.weight": ((C, C * D), True),    # :185-187 hc_head
        "output_hc_base.weight": ((C,), True),
        "output_hc_scale.weight": ((1,), True),
    }
    if markov_rank is not None:                       # :125-134, only beside markov_w1
        s["markov_w1.weight"] = ((V, markov_rank), True)
        s["markov_w2.weight"] = ((V, markov_rank), True)
        if confidence:
            s["conf_proj.weight"] = ((1, D + markov_rank), True)
            s["conf_proj.bias"] = ((1,), False)
    for i in range(cfg.num_layers):                   # :190-219
        b = f"blk.{i}."
        s.update({
            b + "attn_norm.weight": ((D,), True),
            b + "attn_sinks.weight": ((H,), True),
            b + "attn_q_a.weight": ((Q, D), True),
            b + "attn_q_a_norm.weight": ((Q,), True),
            b + "attn_q_b.weight": ((H * E, Q), True),
            b + "attn_kv.weight": ((E, D), True),
            b + "attn_kv_a_norm.weight": ((E,), True),
            b + "attn_output_a.weight": ((G, O, H * E // G), True),
            b + "attn_output_b.weight": ((D, G * O), True),
            b + "hc_attn_fn.weight": ((mix, C * D), True),
            b + "hc_attn_base.weight": ((mix,), True),
            b + "hc_attn_scale.weight": ((3,), True),
            b + "hc_ffn_fn.weight": ((mix, C * D), True),
            b + "hc_ffn_base.weight": ((mix,), True),
            b + "hc_ffn_scale.weight": ((3,), True),
            b + "ffn_gate_inp.weight": ((X, D), True),
            b + "exp_probs_b.bias": ((X,), True),
            b + "ffn_norm.weight": ((D,), True),
            b + "ffn_gate_exps.weight": ((X, I, D), True),
            b + "ffn_down_exps.weight": ((X, D, I), True),
            b + "ffn_up_exps.weight": ((X, I, D), True),
            b + "ffn_gate_shexp.weight": ((I * S, D), True),
            b + "ffn_down_shexp.weight": ((D, I * S), True),
            b + "ffn_up_shexp.weight": ((I * S, D), True),
        })
    return s


def check_config(cfg: DSV4DraftConfig, target: TargetFacts) -> None:
    """ValueError naming the first hyper-parameter llama.cpp would refuse or mis-serve."""
    def bad(msg: str) -> None:
        raise ValueError(f"DSV4 draft GGUF: {msg}")

    if cfg.hidden_size != target.hidden_size:
        bad(f"hidden_size {cfg.hidden_size} != the target's {target.hidden_size} (llama.cpp feeds the target's "
            "states as they are, common/speculative.cpp:1035-1037)")
    if cfg.hc_mult != 4:
        bad(f"hc_mult {cfg.hc_mult}: llama.cpp's hyper-connections take exactly 4 streams (deepseek4.cpp:366)")
    if cfg.num_heads % cfg.o_groups:
        bad(f"num_heads {cfg.num_heads} is not a multiple of o_groups {cfg.o_groups} (deepseek4.cpp:900)")
    if not 0 < cfg.qk_rope_head_dim <= cfg.head_dim or cfg.qk_rope_head_dim % 2:
        bad(f"qk_rope_head_dim {cfg.qk_rope_head_dim} must be even and in (0, head_dim={cfg.head_dim}]")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        bad(f"num_experts_per_tok {cfg.num_experts_per_tok} must be in [1, num_experts={cfg.num_experts}]")
    for name in ("num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                 "moe_intermediate_size", "num_shared_experts", "block_size", "hc_sinkhorn_iters"):
        if getattr(cfg, name) <= 0:
            bad(f"{name} must be positive, got {getattr(cfg, name)}")
    if not cfg.target_layers:
        bad("target_layers is empty (llama.cpp requires dflash.target_layers, dflash.cpp:37-39)")
    top = target.num_layers if target.arch in FINAL_STATE_ARCHS else target.num_layers - 1
    for k in cfg.target_layers:
        if not 0 <= k <= top:
            bad(f"target layer {k} is not exposed by a {target.arch!r} target of {target.num_layers} layers "
                f"(allowed 0..{top}: the input of layer k; src/models/llama.cpp:127, llama-graph.cpp:1413)")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        bad(f"mask_token_id {cfg.mask_token_id} is outside the target vocabulary of {target.vocab_size}")


def _array(name: str, x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor; the module does not import torch
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"DSV4 draft GGUF: tensor {name} has dtype {a.dtype}, expected a float array")
    if not np.isfinite(a).all():
        raise ValueError(f"DSV4 draft GGUF: tensor {name} holds non-finite values")
    return a


# DeepSeek-V4's `mtp.<stage>.<rest>` names -> llama.cpp's, as its converter maps them (conversion/deepseek.py:813-876
# layer names, :932-938 and :980-1002 the names kept at the root whatever the stage): the inverse of the one name
# table, draft_model/dsv4.py's (ours -> (GGUF, DeepSeek))
_DEEPSEEK_ROOT = {ds: gg for gg, ds in ROOT_NAMES.values()}
_DEEPSEEK_ROOT["confidence_head.proj.bias"] = "conf_proj.bias"  # no DeepSeek checkpoint has one; llama.cpp's does
_DEEPSEEK_LAYER = {ds: gg for gg, ds in STAGE_NAMES.values() if "{e}" not in ds}
_DEEPSEEK_EXPERT = {re.search(r"\.(w[123])\.", ds).group(1): gg for gg, ds in STAGE_NAMES.values() if "{e}" in ds}


def from_deepseek_names(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """DeepSeek-V4 drafter tensors (`mtp.<stage>.*`, unquantized) under llama.cpp's GGUF names: a rename, the
    routed experts stacked [X, out, in]. ValueError for an unknown name, a quantized tensor or a gap in the experts."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for key, value in state.items():
        m = re.fullmatch(r"mtp\.(\d+)\.(.+)", key)
        if m is None:
            raise ValueError(f"DeepSeek-V4 drafter tensor {key!r}: expected mtp.<stage>.<name>")
        stage, rest = int(m.group(1)), m.group(2)
        e = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)", rest)
        if rest.endswith(".scale") or (e and e.group(3) == "scale"):
            raise ValueError(f"DeepSeek-V4 drafter tensor {key!r} is a quantization scale (FP8/MXFP4); "
                             "dequantize the checkpoint first")
        if rest in _DEEPSEEK_ROOT:
            name = _DEEPSEEK_ROOT[rest]
            a = _array(key, value)
            if name in out and not np.array_equal(out[name], a):
                raise ValueError(f"DeepSeek-V4 drafter tensor {key!r} differs from another stage's copy of {name}")
            out[name] = a
        elif rest in _DEEPSEEK_LAYER:
            out[f"blk.{stage}.{_DEEPSEEK_LAYER[rest]}"] = _array(key, value)
        elif e:
            experts.setdefault(f"blk.{stage}.{_DEEPSEEK_EXPERT[e.group(2)]}", {})[int(e.group(1))] = _array(key, value)
        else:
            raise ValueError(f"DeepSeek-V4 drafter tensor {key!r} has no llama.cpp DSV4 counterpart")
    for name, by_id in experts.items():
        if sorted(by_id) != list(range(len(by_id))):
            raise ValueError(f"{name}: expert ids {sorted(by_id)} are not 0..{len(by_id) - 1}")
        out[name] = np.stack([by_id[i] for i in range(len(by_id))])
    return out


def write_dsv4_gguf(path: str | Path, tensors: dict[str, Any], cfg: DSV4DraftConfig, target: TargetFacts,
                    dtype: str = "f32", name: str = "dspark-dsv4-draft", mxfp4_experts: bool = False) -> Path:
    """Write the draft GGUF; ValueError naming the first missing, unknown or ill-shaped tensor or bad key.
    `mxfp4_experts`: the routed experts quantized to MXFP4 by gguf-py (the precision DeepSeek's checkpoint stores
    them in; its converter repacks already-quantized blocks instead)."""
    if dtype not in ("f32", "f16"):
        raise ValueError(f"DSV4 draft GGUF: dtype {dtype!r}; f32 or f16")
    check_config(cfg, target)
    rank = None
    if "markov_w1.weight" in tensors:
        rank = int(np.shape(tensors["markov_w1.weight"])[-1])
    elif "markov_w2.weight" in tensors or "conf_proj.weight" in tensors:
        raise ValueError("DSV4 draft GGUF: markov_w2/conf_proj given without markov_w1.weight (llama.cpp creates "
                         "them only beside it, dflash.cpp:125-134)")
    want = dsv4_shapes(cfg, target.vocab_size, rank, confidence="conf_proj.weight" in tensors)
    for key in tensors:
        if key not in want:
            raise ValueError(f"DSV4 draft GGUF: unknown tensor {key!r}; llama.cpp's DSV4 loader would refuse the "
                             "file (wrong number of tensors); see dsv4_shapes()")
    arrays = {}
    for key, (shape, required) in want.items():
        if key not in tensors:
            if required:
                raise ValueError(f"DSV4 draft GGUF: missing tensor {key!r} of shape {shape}")
            continue
        a = _array(key, tensors[key])
        if key.endswith("attn_output_a.weight") and a.shape == (shape[0] * shape[1], shape[2]):
            a = a.reshape(shape)  # DeepSeek's wo_a [G·O, H·E/G]
        if a.shape != shape:
            raise ValueError(f"DSV4 draft GGUF: tensor {key!r} has shape {tuple(a.shape)}, expected {shape}")
        f32 = dtype == "f32" or a.ndim == 1 or any(p in key for p in _ALWAYS_F32)
        arrays[key] = np.ascontiguousarray(a, dtype=np.float32 if f32 else np.float16)

    w = gguf.GGUFWriter(str(path), ARCH)
    _write_keys(w, cfg, target, name, has_conf="conf_proj.weight" in arrays)
    for key, a in arrays.items():
        if mxfp4_experts and key.endswith("_exps.weight"):
            q = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            w.add_tensor(key, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(key, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _write_keys(w: gguf.GGUFWriter, cfg: DSV4DraftConfig, target: TargetFacts, name: str, has_conf: bool) -> None:
    T = gguf.GGUFValueType
    u32 = {  # src/llama-model.cpp:1323-1450 (generic), src/models/dflash.cpp:55-70 (DSV4 path)
        "context_length": cfg.context_length,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_layers,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": 1,        # one K=V head: the cache holds one E-wide K per position
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,  # must equal key_length (deepseek4.cpp:899)
        "rope.dimension_count": cfg.qk_rope_head_dim,
        "expert_count": cfg.num_experts,
        "expert_used_count": cfg.num_experts_per_tok,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_count": cfg.num_shared_experts,
        "expert_gating_func": SQRT_SOFTPLUS,
        "attention.q_lora_rank": cfg.q_lora_rank,
        "attention.sliding_window": cfg.sliding_window,
        "attention.output_group_count": cfg.o_groups,
        "attention.output_lora_rank": cfg.o_lora_rank,
        "hyper_connection.count": cfg.hc_mult,
        "hyper_connection.sinkhorn_iterations": cfg.hc_sinkhorn_iters,
        "block_size": cfg.block_size,
    }
    f32 = {
        "rope.freq_base": cfg.rope_theta,
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "expert_weights_scale": cfg.routed_scaling_factor,
        "hyper_connection.epsilon": cfg.hc_eps,
    }
    boolean = {
        "expert_weights_norm": cfg.norm_topk_prob,
        "attention.causal": False,           # bidirectional in-block attention (common/speculative.cpp:1049-1051)
        "sample_from_anchor": cfg.sample_from_anchor,
        "has_confidence_head": has_conf,
    }
    w.add_name(name)
    for k, v in u32.items():
        w.add_key_value(f"{ARCH}.{k}", int(v), T.UINT32)
    for k, v in f32.items():
        w.add_key_value(f"{ARCH}.{k}", float(v), T.FLOAT32)
    for k, v in boolean.items():
        w.add_key_value(f"{ARCH}.{k}", bool(v), T.BOOL)
    n = cfg.num_layers
    w.add_key_value(f"{ARCH}.swiglu_clamp_exp", [float(cfg.swiglu_limit)] * n, T.ARRAY, T.FLOAT32)
    w.add_key_value(f"{ARCH}.swiglu_clamp_shexp", [float(cfg.swiglu_limit)] * n, T.ARRAY, T.FLOAT32)
    w.add_key_value(f"{ARCH}.attention.compress_ratios", [0] * n, T.ARRAY, T.UINT32)
    w.add_key_value(f"{ARCH}.target_layers", [int(k) for k in cfg.target_layers], T.ARRAY, T.INT32)
    for k, (v, vtype, sub) in target.tokenizer.items():
        w.add_key_value(k, v, vtype, sub)
    w.add_key_value("tokenizer.ggml.mask_token_id", int(cfg.mask_token_id), T.UINT32)
