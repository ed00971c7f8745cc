"""A tiny random DeepSeek-V4 target in the layout DeepSeek publishes its checkpoints in (what vLLM's DeepSeek-V4
loader reads, and what transformers 5.24 converts on load): `embed.weight`, `layers.N.attn.kv_norm.weight`,
`hc_head_fn`, `head.weight`, ..., and a config.json with `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`,
`topk_method: noaux_tc`. transformers' `save_pretrained` writes its own mixture of names and config fields, which
vLLM 0.32 refuses. Sizes: the smallest vLLM's V4 kernels accept (head_dim 512, indexer head_dim 128, rope 64).
Used by tests/test_deepseek_layout.py and the vllm-marked tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from workers.frozen_target.model import save_target

# transformers' saved name -> DeepSeek's (after the "model." prefix is dropped)
_RENAMES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale"}


def tiny_v4(tokenizer, seed: int = 0, hidden_size: int = 256):
    """Four layers, one of each attention kind (sliding, CSA, HCA) and a hash-routed first MoE layer."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    H = hidden_size
    config = DeepseekV4Config(
        vocab_size=len(tokenizer), hidden_size=H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        moe_intermediate_size=H // 2, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, head_dim=512, q_lora_rank=H // 2,
        o_groups=2, o_lora_rank=H // 2, index_n_heads=4, index_head_dim=128, index_topk=16, sliding_window=128,
        hc_mult=4, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def save_deepseek_layout(model, tokenizer, out_dir: str | Path) -> Path:
    """save_target, then names and config rewritten to DeepSeek's published layout."""
    from safetensors.torch import load_file, save_file

    out = save_target(model, tokenizer, out_dir)
    for file in out.glob("*.safetensors"):
        state = load_file(str(file))
        renamed = {}
        for key, t in state.items():
            key = key.removeprefix("model.")
            key = re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", _RENAMES.get(key, key))
            renamed[key] = t.contiguous()
        save_file(renamed, str(file), metadata={"format": "pt"})
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    rates = {"sliding_attention": 0, **cfg.pop("compress_rates")}
    cfg["compress_ratios"] = [rates[t] for t in cfg.pop("layer_types")]
    cfg["num_hash_layers"] = sum(t == "hash_moe" for t in cfg.pop("mlp_layer_types"))
    rope = cfg.pop("rope_parameters")
    cfg.pop("partial_rotary_factor", None)
    cfg["rope_theta"], cfg["compress_rope_theta"] = rope["main"]["rope_theta"], rope["compress"]["rope_theta"]
    cfg["topk_method"] = "noaux_tc"
    path.write_text(json.dumps(cfg, indent=1))
    return out
