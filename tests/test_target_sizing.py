"""Target sizing (workers/frozen_target/sizing.py) on tiny configs, against numbers worked out by hand: the weights
in the bytes the checkpoint stores (bf16/fp32, FP8 blocks, V4's MXFP4 experts) and split by the sharding plan,
the capture's bytes per token, the largest forward that fits and the worker's refusal after loading; a vLLM
engine rank (target.backend=vllm): layers split over pipeline stages as vLLM splits them, heads, MLPs, experts and
vocabulary over tp (KV heads replicated beyond their count), the KV cache that must hold one step; under -m slow
the TP = 2 share equals what a real 2-rank gloo group holds.

Run: python -m pytest -q tests/test_target_sizing.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from transformers import DeepseekV4Config, LlamaConfig

from pipeline.config import RunConfig
from workers.frozen_target import sizing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/memory.py: the presets' target configs

V, D, I, L, H, KV = 1000, 64, 128, 2, 4, 2  # a tiny Llama: every parameter counted by hand below


def _llama(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                       num_key_value_heads=KV, tie_word_embeddings=False, **kw)


HEAD_DIM = D // H
LINEAR = L * (2 * D * D + 2 * D * KV * HEAD_DIM + 3 * D * I)  # q, o, k, v, gate, up, down
OTHER = 2 * V * D + L * 2 * D + D  # embedding, LM head, two norms per layer, the final norm


def _cfg(tp: int = 1, dtype: str = "float32", max_tokens: int = 64, max_len: int = 16, layers=(-1,),
         backend: str = "transformers", pp: int = 1, kv_cache_bytes: int = 2 ** 20) -> RunConfig:
    cfg = RunConfig()
    cfg.target.tp_size, cfg.target.dtype, cfg.target.max_tokens_per_forward = tp, dtype, max_tokens
    cfg.target.backend, cfg.target.pp_size, cfg.target.vllm_kv_cache_gib = backend, pp, kv_cache_bytes / sizing.GIB
    cfg.data.max_len, cfg.draft.target_layers = max_len, list(layers)
    return cfg


def test_weights_are_counted_in_the_loaded_dtype_and_split_by_the_plan():
    fp32 = sizing.target_memory(_cfg(), 1.0, _llama())
    assert fp32.weights_gib * sizing.GIB == 4 * (LINEAR + OTHER)
    bf16 = sizing.target_memory(_cfg(dtype="bfloat16"), 1.0, _llama())
    assert bf16.weights_gib * sizing.GIB == 2 * (LINEAR + OTHER)
    # Llama's plan splits every projection, the embedding and the LM head over the group; norms stay whole
    tp2 = sizing.target_memory(_cfg(tp=2, dtype="bfloat16"), 1.0, _llama())
    assert tp2.weights_gib * sizing.GIB == 2 * (LINEAR / 2 + V * D + L * 2 * D + D)


def test_fp8_checkpoints_store_linear_weights_in_one_byte_plus_block_scales():
    cfg = _llama(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    got = sizing.target_memory(_cfg(dtype="bfloat16"), 1.0, cfg).weights_gib * sizing.GIB
    assert got == pytest.approx(LINEAR * (1 + 4 / 256) + 2 * OTHER, rel=1e-12)  # embedding and head stay bf16


def _tiny_v4(**kw) -> DeepseekV4Config:
    return DeepseekV4Config(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4, head_dim=32,
                            num_key_value_heads=1, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=8,
                            num_experts_per_tok=2, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
                            index_topk=8, sliding_window=16, hc_mult=4, **kw)


def test_v4_fp4_experts_and_its_eager_attention():
    plain = _tiny_v4()
    quant = _tiny_v4(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    quant.expert_dtype = "fp4"
    model = sizing.meta_model(plain, torch.bfloat16)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and p.ndim == 3)
    assert experts == 2 * 8 * 3 * 32 * D  # two layers of 8 experts, gate+up+down of 32 x 64
    a = sizing.target_memory(_cfg(dtype="bfloat16"), 1.0, plain).weights_gib * sizing.GIB
    b = sizing.target_memory(_cfg(dtype="bfloat16"), 1.0, quant).weights_gib * sizing.GIB
    linear_gap = a - b - experts * (2 - (0.5 + 1 / 32))  # what FP8 saved on the linear layers
    assert linear_gap > 0 and (a - b) > experts * 1.4
    # eager only (per-head sinks): 4 heads x 16 keys x (2 + 2 + 4) bytes of scores per token dominate
    assert model.config._attn_implementation == "eager"
    per_token = sizing.bytes_per_token(plain, "eager", 1, 0, 16, torch.bfloat16)
    transient = max((2 * 4 + 2 * 1) * 32, 2 * (D + 3 * 32) + 3 * 32)  # attention widths vs routed + shared MoE
    assert per_token == 2 * (2 * 4 * D + transient + D) + 4 * 16 * 8


def test_capture_bytes_per_token_and_the_largest_forward():
    # fp32, sdpa: 2 x D of residual in and out, the larger of attention (2H + 2KV heads) and MLP (3I), one sent
    # layer and the LM-head input kept, and a 16-byte row of the padding mask
    per_token = 4 * (2 * D + max((2 * H + 2 * KV) * HEAD_DIM, 3 * I) + 2 * D) + 16
    assert sizing.bytes_per_token(_llama(), "sdpa", 1, 1, 16, torch.float32) == per_token
    weights = 4 * (LINEAR + OTHER)
    gpu_gib = (weights + 1000 * per_token) / sizing.GIB / (1 - sizing.RESERVE)  # room for 1000 tokens exactly
    mem = sizing.target_memory(_cfg(max_tokens=1000, layers=[1, -1]), gpu_gib, _llama())
    assert mem.max_tokens_per_forward == 1000 and mem.fits
    assert mem.capture_gib * sizing.GIB == 1000 * per_token
    over = sizing.target_memory(_cfg(max_tokens=1001, layers=[1, -1]), gpu_gib, _llama())
    assert not over.fits and over.max_tokens_per_forward == 1000
    # not even one sequence of data.max_len: no forward fits at all
    assert sizing.target_memory(_cfg(max_len=2000, max_tokens=2000), gpu_gib, _llama()).max_tokens_per_forward == 0


def test_a_worker_refuses_a_forward_the_weights_leave_no_room_for(monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_llama())
    per_token = sizing.bytes_per_token(model.config, model.config._attn_implementation, 1, 0, 16, torch.float32)
    free = 500 * per_token / (1 - sizing.RESERVE)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free, 80 * sizing.GIB))
    sizing.check_forward_fits(model, 500, [-1], seq_len=16)
    with pytest.raises(ValueError, match=r"^target.max_tokens_per_forward=501 does not fit .* use at most 500$"):
        sizing.check_forward_fits(model, 501, [-1], seq_len=16)


def test_vllm_splits_layers_over_stages_as_vllm_does():
    assert sizing.pp_stages(61, 2) == [range(0, 31), range(31, 61)]  # the remainder before the last stage
    assert sizing.pp_stages(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert sizing.pp_stages(4, 1) == [range(0, 4)]


def _vllm_stages(config, tp: int, pp: int, dtype=torch.bfloat16) -> list[float]:
    return sizing.vllm_stage_weight_bytes(sizing.meta_model(config, dtype), config, tp, pp)


def test_vllm_rank_weights_by_hand():
    per_layer_split = 2 * D * D + 3 * D * I  # q, o, gate, up, down: split by tp
    kv = 2 * D * KV * HEAD_DIM  # k, v: split by KV head
    # tp 2, pp 2: stage 0 = layer 0 + the embedding, stage 1 = layer 1 + the final norm + the LM head (bf16)
    got = _vllm_stages(_llama(), 2, 2)
    assert got == [2 * (per_layer_split / 2 + kv / 2 + 2 * D + V * D / 2),
                   2 * (per_layer_split / 2 + kv / 2 + 2 * D + D + V * D / 2)]
    # tp 4 > 2 KV heads: each rank keeps one KV head (half of k and v), the rest splits four ways
    (tp4,) = _vllm_stages(_llama(), 4, 1)
    assert tp4 == 2 * (L * (per_layer_split / 4 + kv / 2 + 2 * D) + 2 * V * D / 4 + D)
    # over all ranks: the whole model, plus the copies of what vLLM replicates (norms; here no KV head)
    whole = 2 * (LINEAR + OTHER)
    assert sum(got) * 2 == whole + (2 - 1) * 2 * (L * 2 * D + D)
    assert sum(_vllm_stages(_llama(), 1, 2)) == whole  # pp alone copies nothing
    # a tied embedding is held by the first and the last stage
    tied = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=H,
                       num_key_value_heads=KV, tie_word_embeddings=True)
    assert sum(_vllm_stages(tied, 1, 2)) == whole


def test_vllm_v4_splits_experts_and_projections_and_replicates_the_rest():
    quant = _tiny_v4(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    quant.expert_dtype = "fp4"
    model = sizing.meta_model(quant, torch.bfloat16)
    stored = dict(sizing.param_stored_bytes(model, quant))
    split = ("embed_tokens", "lm_head", ".experts.", "shared_experts.", "q_b_proj", "o_a_proj", "o_b_proj")
    split_bytes = sum(b for n, b in stored.items() if any(k in n for k in split) and "compressor" not in n)
    assert 0 < split_bytes < sum(stored.values())
    (tp2,) = _vllm_stages(quant, 2, 1)
    assert tp2 == pytest.approx(sum(stored.values()) - split_bytes / 2, rel=1e-12)
    # the routed experts stay MXFP4 (0.5 byte + a scale per 32), the linear layers FP8: vLLM keeps them quantized
    experts = sum(b for n, b in stored.items() if ".experts." in n)
    assert experts == 2 * 8 * 3 * 32 * D * (0.5 + 1 / 32)
    # pp 2 of 2 layers: one layer a stage, each with its half of the decoder
    first, last = _vllm_stages(quant, 1, 2)
    layer = [sum(b for n, b in stored.items() if f".layers.{i}." in n) for i in (0, 1)]
    assert first == layer[0] + stored["model.embed_tokens.weight"]
    assert last == layer[1] + sum(b for n, b in stored.items() if ".layers." not in n and "embed_tokens" not in n)


def test_vllm_rank_memory_kv_cache_and_prefill():
    # tp 2, pp 2, bf16, the final state captured: one aux state (vLLM's id L)
    act = 2 * (2 * D + max((2 * H + 2 * KV) * HEAD_DIM / 2, 3 * I) + 1 * D)  # residual, MLP, the aux state
    kv = 2 * (1 * 2 * (KV // 2) * HEAD_DIM + 1 * D)  # one layer's K and V (one head a rank) + the aux state
    weights = max(_vllm_stages(_llama(), 2, 2))
    tokens = 1000
    cache = (tokens + 1) * kv  # exactly one step of max_tokens_per_forward + 1
    gpu_gib = (weights + cache + tokens * act) / sizing.GIB / (1 - sizing.RESERVE)
    cfg = _cfg(tp=2, pp=2, dtype="bfloat16", max_tokens=tokens, backend="vllm", kv_cache_bytes=cache)
    mem = sizing.target_memory(cfg, gpu_gib, _llama())
    assert mem.fits and mem.max_tokens_per_forward == tokens
    assert mem.weights_gib * sizing.GIB == weights and mem.capture_gib * sizing.GIB == cache + tokens * act
    # a KV cache one token short refuses the step, and names the step it holds
    short = _cfg(tp=2, pp=2, dtype="bfloat16", max_tokens=tokens, backend="vllm", kv_cache_bytes=cache - kv)
    mem = sizing.target_memory(short, gpu_gib, _llama())
    assert not mem.fits and mem.max_tokens_per_forward == tokens - 1
    # room for the cache but not the prefill: the largest forward is what the GPU leaves
    over = _cfg(tp=2, pp=2, dtype="bfloat16", max_tokens=tokens, backend="vllm", kv_cache_bytes=cache + 10 * kv)
    mem = sizing.target_memory(over, gpu_gib, _llama())
    assert not mem.fits and mem.max_tokens_per_forward == int((tokens * act - 10 * kv) // act)


def _local_bytes(rank: int, world: int, path: str) -> int:
    from workers.frozen_target.sharding import distributed_config
    from workers.frozen_target.worker import TargetWorker

    return TargetWorker(path, [-1], distributed=distributed_config(world, False)).param_bytes()


@pytest.mark.slow
def test_the_tp2_share_is_what_a_real_group_rank_holds():
    from transformers import AutoConfig

    from workers.frozen_target.model import resolve_target_path

    path = str(resolve_target_path("tiny-qwen3-moe"))
    held = run_ranks(_local_bytes, 2, path, timeout=300)
    want = sizing.target_memory(_cfg(tp=2), 1.0, AutoConfig.from_pretrained(path)).weights_gib * sizing.GIB
    assert held[0] == held[1] == want


def test_the_presets_targets_fit_their_gpus_by_the_vllm_estimate():
    """launch/configs/v4-{flash,pro}.yaml on the models bench/memory.py sizes (public configs, stored FP8 + FP4):
    each fits its GPU with the KV cache and step the preset names; v4-pro needs pp 2 on 80 GiB GPUs."""
    from memory import PRESET_GPU, v4_model_config

    from pipeline.config import load_config

    for preset in ("v4-flash", "v4-pro"):
        cfg = load_config(ROOT / "launch" / "configs" / f"{preset}.yaml")
        assert cfg.target.backend == "vllm" and cfg.target.expert_parallel, preset
        mem = sizing.target_memory(cfg, PRESET_GPU[preset][1], v4_model_config(preset))
        assert mem.fits and mem.max_tokens_per_forward >= cfg.target.max_tokens_per_forward, (preset, mem)
    pro = v4_model_config("v4-pro")
    one_node = load_config(ROOT / "launch" / "configs" / "v4-pro.yaml")
    assert not sizing.target_memory(one_node, 80, pro).fits
    two_nodes = load_config(ROOT / "launch" / "configs" / "v4-pro.yaml", ["target.tp_size=16",
                                                                          "target.vllm_executor=ray"])
    assert sizing.target_memory(two_nodes, 80, pro).fits
