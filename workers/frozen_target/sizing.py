"""How much GPU memory one rank of a target group (transformers) or of a vLLM engine needs: its share of the weights
in the bytes the checkpoint stores, and the capture forward above them at `target.max_tokens_per_forward` (on
vLLM, its KV cache as well); the largest forward that fits what the weights leave.

Transformers, weights: the model is built on the meta device from its config (no memory, no checkpoint read) and
each parameter is counted once, divided by tp_size where transformers' sharding plan splits it
(`base_model_tp_plan`, and with expert parallelism `base_model_ep_plan`: whole experts per rank;
workers/frozen_target/sharding.py checks the same plans), in the bytes per parameter it is loaded with: a
`quantization_config` of method fp8 stores the linear and expert weights in 1 byte plus one fp32 scale per weight
block (`weight_block_size`, 128 x 128 by default); a DeepSeek-V4 config with `expert_dtype: fp4` (V4-Flash) stores
its routed experts as MXFP4, 0.5 byte plus a 1-byte scale per 32; an mxfp4 quantization_config does that for every
expert. Everything else (embeddings, the LM head, norms, routers, hyper-connection mixers) is counted in the dtype
the meta model holds it in: `target.dtype`, or fp32 where the model keeps a module in fp32 (DeepSeek-V4's hc_head).
Without a quantization_config every weight is loaded in `target.dtype`.

Capture: estimated from activation shapes (not from a traced forward), per token of a forward, in `target.dtype`:
- the residual stream into and out of the running decoder layer, hc_mult streams wide on DeepSeek-V4 (2 S D);
- the largest transient inside one layer: the attention projections (q, k, v and the output, heads split over the
  group where the plan splits attention), or the MoE's routed copies (top_k x (D + 3 I_moe) per token, over the
  group) plus its shared experts, or a dense MLP (3 I);
- attention itself: with SDPA only the padding mask, one byte per key (B x L x L for B sequences of length L =
  data.max_len); an eager-only model (DeepSeek-V4 in transformers 5.24: its per-head sinks keep SDPA off) holds
  its scores in the compute dtype and their fp32 softmax, H x L x (2 b + 4) bytes per token;
- the states the capture hooks keep: one [T, D] per sent layer (reduced from V4's streams as they are seen) and
  the LM-head input (workers/frozen_target/model.capture_features).
The logits are the last position's only (lm_head_input), a few MiB: left out. So is DeepSeek-V4's compressor and
sparse indexer (their tensors are a fraction of the attention scores above). A `RESERVE` fraction of the GPU is
kept for the CUDA context, NCCL's buffers and the allocator's fragmentation.

vLLM (`target.backend: vllm`, `vllm_rank_memory`): the largest rank of one engine of tp x pp GPUs.
- Weights, in the same stored bytes (vLLM loads DeepSeek-V4's FP8 / MXFP4 checkpoint as is:
  vllm/models/deepseek_v4/quant_config.py), split as vLLM shards them: the decoder layers over the pp stages
  (`pp_stages`, vLLM's get_pp_indices), the embedding on the first stage and the LM head on the last (both
  vocab-parallel), and within a stage over the tp ranks: attention and MLP projections, shared and routed experts
  (whole experts with expert parallelism, slices otherwise: the same bytes), K and V by KV head (one at least a
  rank); the rest (norms, routers, hyper-connection mixers, V4's compressor and indexer) held by every rank
  (`VLLM_TP_SPLIT`, `vllm_tp_divisor`).
- The KV cache, `target.vllm_kv_cache_gib` per rank, which vLLM reserves whole (kv_cache_memory_bytes). One engine
  step takes max_num_batched_tokens = max_model_len = max_tokens_per_forward + 1 tokens (engine.engine_kwargs), and
  vLLM refuses to start when its KV cache cannot hold one request of max_model_len
  (v1/core/kv_cache_utils.py check_enough_kv_cache_memory), so it must hold that many tokens of this rank's layers'
  K and V (an upper bound: MLA's and V4's compressed caches are smaller) plus the captured states, which
  extract_hidden_states keeps in the KV cache as one more layer, [aux ids, D] a token on every rank, until they are
  handed over (`vllm_kv_bytes_per_token`).
- One prefill of max_tokens_per_forward tokens: the same residual / transient / kept-states terms as above
  (`_activation_bytes`) with the attention heads split by tp too; no attention-score term (vLLM's attention
  kernels do not materialise L x L scores); the aux states are the kept ones.

Run: python -m pytest -q tests/test_target_sizing.py
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

import torch

from draft_model.config import FINAL_HIDDEN
from pipeline.config import RunConfig

GIB = 2 ** 30
RESERVE = 0.10  # of the GPU: CUDA context, NCCL buffers, allocator fragmentation
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class TargetMemory:
    weights_gib: float  # one group rank's share of the weights, in the checkpoint's bytes
    capture_gib: float  # peak above the weights at target.max_tokens_per_forward (vLLM: its KV cache included)
    gpu_gib: float  # the GPU it was sized for
    max_tokens_per_forward: int  # the largest forward that fits what the weights leave (0: not one sequence)
    fits: bool  # weights + capture within the GPU less RESERVE (vLLM: and the KV cache holds one forward)


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def meta_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `config` on the meta device (shapes and dtypes only)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _split_by_plan(name: str, plan: dict[str, str]) -> bool:
    """Whether parameter `name` (e.g. model.layers.3.mlp.experts.gate_up_proj) sits under a rule of the plan (full
    module names, `*` for a layer index) that shards it: every style except the replicated ones."""
    for key, style in plan.items():
        if "replicate" in style:
            continue
        pattern = key.replace("*", "[0-9]*")
        if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
            return True
    return False


def sharding_plan(model: torch.nn.Module, config: Any, tp_size: int, expert_parallel: bool) -> dict[str, str]:
    """The plan transformers shards a group's model by: the model's whole tp_plan (its base model's rules, the
    embedding and the LM head), with expert parallelism its experts' rules replaced by the EP plan's."""
    if tp_size == 1:
        return {}
    plan = dict(getattr(model, "tp_plan", None) or {})
    if expert_parallel:
        prefix = model.base_model_prefix
        plan.update({f"{prefix}.{k}": v for k, v in (getattr(_text_config(config), "base_model_ep_plan", None)
                                                      or {}).items()})
    return plan


def _stored_bytes(name: str, param: torch.Tensor, is_linear: bool, quant: dict, fp4_experts: bool) -> float:
    """Bytes per element of one parameter as the checkpoint stores it (kept so by transformers' quantizer and vLLM)."""
    expert = ".experts." in name and param.ndim == 3
    if expert and (fp4_experts or quant.get("quant_method") == "mxfp4"):
        return 0.5 + 1 / 32  # MXFP4: two values a byte, one E8M0 scale per 32
    if quant.get("quant_method") == "fp8" and (expert or is_linear):
        bs = quant.get("weight_block_size") or FP8_BLOCK
        return 1 + 4 / (bs[0] * bs[1])
    return param.element_size()


def param_stored_bytes(model: torch.nn.Module, config: Any) -> list[tuple[str, float]]:
    """(name, bytes) of every parameter of the meta model, whole, as the checkpoint stores it."""
    cfg = _text_config(config)
    quant = getattr(config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    fp4_experts = bool(quant) and getattr(cfg, "expert_dtype", None) == "fp4"
    head = model.get_output_embeddings()
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    return [(name, p.numel() * _stored_bytes(name, p, name in linear, quant, fp4_experts))
            for name, p in model.named_parameters()]


def rank_weight_bytes(model: torch.nn.Module, config: Any, tp_size: int, expert_parallel: bool) -> float:
    """One transformers group rank's share of the weights, in stored bytes."""
    plan = sharding_plan(model, config, tp_size, expert_parallel)
    return sum(b / (tp_size if _split_by_plan(name, plan) else 1) for name, b in param_stored_bytes(model, config))


def _activation_bytes(config: Any, attn_tp: int, moe_tp: int, kept_states: int, b: int) -> float:
    """Per token of a forward, in b-byte elements: the residual stream in and out of the running layer (hc_mult
    streams wide), the largest transient inside one layer (attention projections with heads split attn_tp ways,
    routed + shared experts with the routed copies split moe_tp ways, or a dense MLP) and `kept_states` [T, D]
    states held until the forward ends. Shared by both backends; the attention scores are not in it."""
    cfg = _text_config(config)
    d = cfg.hidden_size
    streams = getattr(cfg, "hc_mult", 1) or 1
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attention = (2 * heads + 2 * kv_heads) * head_dim / attn_tp
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    moe_i = getattr(cfg, "moe_intermediate_size", 0) or 0
    shared = (getattr(cfg, "n_shared_experts", 0) or 0) * 3 * moe_i
    moe = top_k * (d + 3 * moe_i) / moe_tp + shared if top_k else 0
    dense = 3 * (getattr(cfg, "intermediate_size", 0) or 0)
    return b * (2 * streams * d + max(attention, moe, dense) + kept_states * d)


def bytes_per_token(config: Any, attn_impl: str, tp_size: int, sent_layers: int, seq_len: int,
                    dtype: torch.dtype) -> float:
    """Activation bytes one token of a transformers capture forward costs (module docstring: the terms and why)."""
    cfg = _text_config(config)
    b = torch.empty((), dtype=dtype).element_size()
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    attn_tp = tp_size if any("self_attn" in k for k in plan) else 1
    if attn_impl == "eager":  # the scores in the compute dtype, their fp32 softmax
        scores = cfg.num_attention_heads / attn_tp * seq_len * (2 * b + 4)
    else:
        scores = seq_len  # SDPA's boolean padding mask
    return _activation_bytes(config, attn_tp, tp_size, sent_layers + 1, b) + scores


def _model_config(path: str) -> Any:
    from transformers import AutoConfig

    from workers.frozen_target.model import resolve_target_path

    return AutoConfig.from_pretrained(str(resolve_target_path(path)))


def target_memory(cfg: RunConfig, gpu_gib: float, model_config: Any = None) -> TargetMemory:
    """The memory of one target rank for run config `cfg` on a GPU of `gpu_gib` GiB, for the backend it names
    (target.backend: a transformers group rank, or a vLLM engine rank: vllm_rank_memory). `model_config`: a
    transformers PretrainedConfig; None reads cfg.target.path's config.json."""
    model_config = model_config if model_config is not None else _model_config(cfg.target.path)
    if cfg.target.backend == "vllm":
        return vllm_rank_memory(cfg, gpu_gib, model_config)
    t = cfg.target
    dtype = getattr(torch, t.dtype)  # a name the config's range admits (float32, bfloat16, float16)
    model = meta_model(model_config, dtype)
    weights = rank_weight_bytes(model, model_config, t.tp_size, t.expert_parallel)
    sent = len({i for i in cfg.draft.target_layers if i != FINAL_HIDDEN})
    per_token = bytes_per_token(model_config, model.config._attn_implementation, t.tp_size, sent,
                                min(cfg.data.max_len, t.max_tokens_per_forward), dtype)
    return fit(cfg, gpu_gib, weights, 0.0, per_token)


def fit(cfg: RunConfig, gpu_gib: float, weights: float, reserved: float, per_token: float,
        room_tokens: float = float("inf")) -> TargetMemory:
    """The TargetMemory of a rank holding `weights` and `reserved` bytes (vLLM's KV cache) whose forward costs
    `per_token` bytes a token; `room_tokens`: another bound on one forward's tokens (what the KV cache holds)."""
    t = cfg.target
    usable = gpu_gib * GIB * (1 - RESERVE)
    capture = per_token * t.max_tokens_per_forward
    largest = max(0, int(min((usable - weights - reserved) // per_token, room_tokens)))
    if largest < cfg.data.max_len:  # a sequence runs whole: less than one of the longest is no forward at all
        largest = 0
    fits = weights + reserved + capture <= usable and t.max_tokens_per_forward <= room_tokens
    return TargetMemory(weights / GIB, (reserved + capture) / GIB, gpu_gib, largest, fits)


# vLLM's tensor-parallel modules, by the transformers name of the module holding a parameter: column / row
# parallel linears (vllm/model_executor/models/llama.py, qwen3_moe.py, deepseek_v2.py; DeepSeek-V4's wq_b, wo_a,
# wo_b in vllm/models/deepseek_v4/attention.py are transformers' q_b_proj, o_a_proj, o_b_proj) and the
# vocab-parallel embedding and LM head. Routed and shared experts are split too: whole experts per rank with
# expert parallelism, a slice of each otherwise (the same bytes). Replicated: norms, routers, hyper-connection
# mixers, DeepSeek-V4's fused q_a/kv projection, its compressor (disable_tp) and indexer (ReplicatedLinear).
VLLM_TP_SPLIT = frozenset({"embed_tokens", "lm_head", "q_proj", "o_proj", "q_b_proj", "kv_b_proj", "o_a_proj",
                           "o_b_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"})
VLLM_TP_REPLICATED = frozenset({"compressor", "indexer"})
VLLM_KV_PROJ = frozenset({"k_proj", "v_proj"})  # split by KV head: a rank holds at least one (replicated beyond)
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def pp_stages(num_layers: int, pp_size: int) -> list[range]:
    """The decoder layers of each pipeline stage as vLLM splits them (vllm/distributed/utils.py get_pp_indices,
    without VLLM_PP_LAYER_PARTITION): evenly, the remainder one each to the stages before the last."""
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def vllm_tp_divisor(name: str, tp_size: int, kv_heads: int) -> int:
    """How many ways vLLM's tensor parallelism divides parameter `name` (transformers naming) over the tp ranks."""
    parts = name.split(".")
    if VLLM_TP_REPLICATED.intersection(parts):
        return 1
    if "experts" in parts or "shared_experts" in parts or parts[-2] in VLLM_TP_SPLIT:
        return tp_size
    if parts[-2] in VLLM_KV_PROJ:
        return min(tp_size, kv_heads)
    return 1


def vllm_stage_weight_bytes(model: torch.nn.Module, config: Any, tp_size: int, pp_size: int) -> list[float]:
    """One tp rank's weights in each pipeline stage, in stored bytes (vLLM keeps FP8 / FP4 checkpoints
    quantized). Stage 0 holds the embedding, the last stage the final norm, the LM head (a tied one as well) and
    every other weight outside the decoder layers."""
    cfg = _text_config(config)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    stage_of = {i: s for s, layers in enumerate(pp_stages(cfg.num_hidden_layers, pp_size)) for i in layers}
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) and model.get_output_embeddings() is not None
    stages = [0.0] * pp_size
    for name, b in param_stored_bytes(model, config):
        share = b / vllm_tp_divisor(name, tp_size, kv_heads)
        layer = _LAYER.search(name)
        if layer:
            held = {stage_of[int(layer.group(1))]}
        elif "embed_tokens" in name:
            held = {0, pp_size - 1} if tied else {0}
        else:
            held = {pp_size - 1}
        for s in held:
            stages[s] += share
    return stages


def vllm_kv_bytes_per_token(config: Any, tp_size: int, layers: int, aux_states: int, dtype: torch.dtype) -> float:
    """vLLM KV-cache bytes one token of a capture holds on one rank: K and V of each of its `layers` (KV heads split
    by tp, at least one a rank, in the model dtype: an upper bound for MLA's and DeepSeek-V4's compressed caches,
    which are smaller) plus the `aux_states` captured [D] states (extract_hidden_states caches them as one
    more layer of the KV cache, not split by tp: vllm/model_executor/models/extract_hidden_states.py)."""
    cfg = _text_config(config)
    b = torch.empty((), dtype=dtype).element_size()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = max(1, (getattr(cfg, "num_key_value_heads", None) or heads) // tp_size)
    return b * (layers * 2 * kv_heads * head_dim + aux_states * cfg.hidden_size)


def vllm_rank_memory(cfg: RunConfig, gpu_gib: float, model_config: Any) -> TargetMemory:
    """The memory of the largest rank of one vLLM engine (module docstring, "vLLM"): its stage's weights, the KV
    cache vLLM reserves whole (target.vllm_kv_cache_gib), which must hold one step of max_tokens_per_forward + 1
    tokens with their captured states, and the prefill of that step."""
    from workers.frozen_target.vllm_engine.engine import aux_layer_ids

    t = cfg.target
    dtype = getattr(torch, t.dtype)
    model = meta_model(model_config, dtype)
    stages = vllm_stage_weight_bytes(model, model_config, t.tp_size, t.pp_size)
    layers = max(len(r) for r in pp_stages(_text_config(model_config).num_hidden_layers, t.pp_size))
    aux = len(aux_layer_ids(list(cfg.draft.target_layers), _text_config(model_config).num_hidden_layers))
    kv_per_token = vllm_kv_bytes_per_token(model_config, t.tp_size, layers, aux, dtype)
    per_token = _activation_bytes(model_config, t.tp_size, t.tp_size, aux, dtype.itemsize)
    kv_cache = t.vllm_kv_cache_gib * GIB
    return fit(cfg, gpu_gib, max(stages), kv_cache, per_token, kv_cache // kv_per_token - 1)


def check_forward_fits(model: torch.nn.Module, max_tokens_per_forward: int, layers: list[int], seq_len: int,
                       tp_size: int = 1) -> None:
    """On a GPU, after loading: ValueError (one line) when target.max_tokens_per_forward cannot fit the memory the
    weights left (torch.cuda.mem_get_info), naming the largest that does. `seq_len`: the longest sequence a forward
    holds (data.max_len)."""
    free, _ = torch.cuda.mem_get_info()
    config = model.config
    dtype = torch.bfloat16 if getattr(config, "quantization_config", None) else next(model.parameters()).dtype
    per_token = bytes_per_token(config, config._attn_implementation, tp_size,
                                len({i for i in layers if i != FINAL_HIDDEN}),
                                min(seq_len, max_tokens_per_forward), dtype)
    largest = max(0, int(free * (1 - RESERVE) // per_token))
    if max_tokens_per_forward > largest:
        raise ValueError(f"target.max_tokens_per_forward={max_tokens_per_forward} does not fit the "
                         f"{free / GIB:.1f} GiB the target's weights leave on this GPU (about "
                         f"{per_token / 2 ** 20:.2f} MiB per token, workers/frozen_target/sizing.py): use at most "
                         f"{largest}")
