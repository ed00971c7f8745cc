"""How much GPU memory one rank of a target group needs: its share of the weights in the bytes the checkpoint stores,
and the capture forward above them at `target.max_tokens_per_forward`; the largest forward that fits what the
weights leave.

Weights: the model is built on the meta device from its config (no memory, no checkpoint read) and each parameter
is counted once, divided by tp_size where transformers' sharding plan splits it (`base_model_tp_plan`, and with
expert parallelism `base_model_ep_plan`: whole experts per rank; workers/frozen_target/sharding.py checks the same
plans), in the bytes per parameter it is loaded with: a `quantization_config` of method fp8 stores the linear and
expert weights in 1 byte plus one fp32 scale per weight block (`weight_block_size`, 128 x 128 by default); a
DeepSeek-V4 config with `expert_dtype: fp4` (V4-Flash) stores its routed experts as MXFP4, 0.5 byte plus a 1-byte
scale per 32; an mxfp4 quantization_config does that for every expert. Everything else (embeddings, the LM head,
norms, routers, hyper-connection mixers) is counted in the dtype the meta model holds it in: `target.dtype`, or
fp32 where the model keeps a module in fp32 (DeepSeek-V4's hc_head). Without a quantization_config every weight is
loaded in `target.dtype`.

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

Run: python -m pytest -q tests/test_target_sizing.py
"""

from __future__ import annotations

import fnmatch
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
    capture_gib: float  # peak above the weights of one capture forward at target.max_tokens_per_forward
    gpu_gib: float  # the GPU it was sized for
    max_tokens_per_forward: int  # the largest forward that fits what the weights leave (0: not one sequence)
    fits: bool  # weights + capture within the GPU less RESERVE


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
    """Bytes per element of one parameter as the checkpoint stores it (loaded as is by transformers' quantizer)."""
    expert = ".experts." in name and param.ndim == 3
    if expert and (fp4_experts or quant.get("quant_method") == "mxfp4"):
        return 0.5 + 1 / 32  # MXFP4: two values a byte, one E8M0 scale per 32
    if quant.get("quant_method") == "fp8" and (expert or is_linear):
        bs = quant.get("weight_block_size") or FP8_BLOCK
        return 1 + 4 / (bs[0] * bs[1])
    return param.element_size()


def rank_weight_bytes(model: torch.nn.Module, config: Any, tp_size: int, expert_parallel: bool) -> float:
    """One group rank's share of the weights, in stored bytes."""
    cfg = _text_config(config)
    plan = sharding_plan(model, config, tp_size, expert_parallel)
    quant = getattr(config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    fp4_experts = bool(quant) and getattr(cfg, "expert_dtype", None) == "fp4"
    head = model.get_output_embeddings()
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
    total = 0.0
    for name, p in model.named_parameters():
        share = p.numel() / (tp_size if _split_by_plan(name, plan) else 1)
        total += share * _stored_bytes(name, p, name in linear, quant, fp4_experts)
    return total


def bytes_per_token(config: Any, attn_impl: str, tp_size: int, sent_layers: int, seq_len: int,
                    dtype: torch.dtype) -> float:
    """Activation bytes one token of a capture forward costs (module docstring: the terms and why)."""
    cfg = _text_config(config)
    b = torch.empty((), dtype=dtype).element_size()
    d = cfg.hidden_size
    streams = getattr(cfg, "hc_mult", 1) or 1
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    attn_tp = tp_size if any("self_attn" in k for k in plan) else 1
    attention = (2 * heads + 2 * kv_heads) * head_dim / attn_tp
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 0
    moe_i = getattr(cfg, "moe_intermediate_size", 0) or 0
    shared = (getattr(cfg, "n_shared_experts", 0) or 0) * 3 * moe_i
    moe = top_k * (d + 3 * moe_i) / tp_size + shared if top_k else 0
    dense = 3 * (getattr(cfg, "intermediate_size", 0) or 0)
    transient = max(attention, moe, dense)
    if attn_impl == "eager":
        scores = heads / attn_tp * seq_len * (2 * b + 4)  # the scores in the compute dtype, their fp32 softmax
    else:
        scores = seq_len  # SDPA's boolean padding mask
    return b * (2 * streams * d + transient + (sent_layers + 1) * d) + scores


def target_memory(cfg: RunConfig, gpu_gib: float, model_config: Any = None) -> TargetMemory:
    """The memory of one target-group rank for run config `cfg` on a GPU of `gpu_gib` GiB. `model_config`: a
    transformers PretrainedConfig; None reads cfg.target.path's config.json."""
    t = cfg.target
    if model_config is None:
        from transformers import AutoConfig

        from workers.frozen_target.model import resolve_target_path

        model_config = AutoConfig.from_pretrained(str(resolve_target_path(t.path)))
    dtype = getattr(torch, t.dtype)  # a name the config's range admits (float32, bfloat16, float16)
    model = meta_model(model_config, dtype)
    weights = rank_weight_bytes(model, model_config, t.tp_size, t.expert_parallel)
    sent = len({i for i in cfg.draft.target_layers if i != FINAL_HIDDEN})
    per_token = bytes_per_token(model_config, model.config._attn_implementation, t.tp_size, sent,
                                min(cfg.data.max_len, t.max_tokens_per_forward), dtype)
    usable = gpu_gib * GIB * (1 - RESERVE)
    capture = per_token * t.max_tokens_per_forward
    largest = max(0, int((usable - weights) // per_token))
    if largest < cfg.data.max_len:  # a sequence runs whole: less than one of the longest is no forward at all
        largest = 0
    return TargetMemory(weights / GIB, capture / GIB, gpu_gib, largest, weights + capture <= usable)


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
