"""A trained v4-deepseek draft (arch "dsv4") in the DeepSeek-V4 checkpoint layout: the drafter a DeepSeek-V4 user
puts into their target checkpoint, and what llama.cpp's `convert_hf_to_gguf.py --dspark` converts.

    from serving.deepseek_checkpoint import write_deepseek_checkpoint
    write_deepseek_checkpoint("runs/v4-deepseek/export", "runs/v4-deepseek/export-deepseek-v4", num_hidden_layers=30)

The directory holds
- `config.json`: a `DeepseekV4ForCausalLM` config with the drafter's hyper-parameters under DeepSeek-V4's names
  (`hidden_size`, `q_lora_rank`, `qk_rope_head_dim`, `o_groups`, `hc_mult`, ...; conversion/deepseek.py:659-689 and
  conversion/base.py's TextModel read them) and the three DSpark keys (`dspark_block_size`,
  `dspark_target_layer_ids` = our hidden-state index - 1, which the converter writes back +1, deepseek.py:1034;
  `dspark_noise_token_id` = the mask token). Keys the drafter does not use but the converter requires (the
  indexer's, `compress_rope_theta`) carry DeepSeek-V4's values; `num_hidden_layers` is the target's depth.
- `model.safetensors`: only `mtp.<stage>.*` tensors (draft_model/dsv4.py's name table), F32, except the routed
  experts, which DeepSeek-V4 stores (and the converter requires) as MXFP4: per expert and projection
  `w{1,2,3}.weight` packed I8 [rows, cols/2] (element 2i in the low nibble, 2i+1 in the high one) and
  `w{1,2,3}.scale` F8_E8M0 [rows, cols/32], one biased exponent per 32 values (conversion/base.py:758-792).

The FP4 values are gguf-py's MXFP4 quantizer's (round to nearest; no quantization-aware training), re-laid from
ggml's blocks into DeepSeek's, which the converter lays back losslessly: the converted GGUF's experts are, byte for
byte, those of `serving.gguf_dsv4.write_dsv4_gguf(..., mxfp4_experts=True)`. The window is DeepSeek's
`sliding_window = W` (every slot sees the W rows before the anchor); the converter writes it as llama.cpp's n_swa
unchanged, so llama.cpp serves a converted drafter one key short at slot 0 (docs/dsv4.md, departure 1), which the
direct GGUF export (n_swa = W + 1) avoids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from draft_model.config import DraftConfig
from draft_model.dsv4 import export_state
from pipeline.export import read_export, write_export_dir
from serving._io import SAFETENSORS_INDEX as INDEX
from serving._io import safetensors_weight_map
from serving.dsv4_gguf_export import require_resolved_dsv4
from serving.layer_ids import check_target_layers

QK = 32  # values per MXFP4 block (one E8M0 scale each)
# DeepSeek-V4's sparse-attention indexer and compressor keys: unused by the drafter (its stages are uncompressed,
# `compress_ratios` all 0), required by the converter
UNUSED_BY_THE_DRAFTER = {"index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_hash_layers": 0}


def mxfp4_pack(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[rows, cols] float -> (packed uint8 [rows, cols/2], E8M0 exponents uint8 [rows, cols/32]), DeepSeek's layout;
    the values are gguf-py's MXFP4 quantization of `w`. ValueError when cols is not a multiple of 32."""
    rows, cols = w.shape
    if cols % QK:
        raise ValueError(f"MXFP4 needs rows of a multiple of {QK} values, got {cols}")
    blocks = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.MXFP4)
    blocks = blocks.reshape(rows, cols // QK, 1 + QK // 2)  # ggml: the scale byte, then 16 code bytes
    scale, qs = blocks[..., 0], blocks[..., 1:]
    # ggml's byte j holds element j (low nibble) and j + 16 (high); DeepSeek's byte i holds 2i (low) and 2i + 1
    vals = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # [rows, blocks, 32] in element order
    pairs = vals.reshape(rows, cols // QK, QK // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return packed.reshape(rows, cols // 2), np.ascontiguousarray(scale, dtype=np.uint8)


def deepseek_config(cfg: DraftConfig, num_hidden_layers: int) -> dict[str, Any]:
    """The DeepseekV4ForCausalLM config.json of a resolved arch-"dsv4" DraftConfig; ValueError for any other."""
    require_resolved_dsv4(cfg, "DeepSeek-V4 checkpoint")
    d, moe = cfg.dsv4, cfg.moe
    for name, n in (("draft.hidden_size", cfg.hidden_size), ("draft.moe.expert_intermediate_size",
                                                             moe.expert_intermediate_size)):
        if n % QK:
            raise ValueError(f"{name}={n}: MXFP4 experts need it to be a multiple of {QK}")
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.resolved_head_dim,
        "qk_rope_head_dim": d.rope_head_dim,
        "q_lora_rank": d.q_lora_rank,
        "o_groups": d.o_groups,
        "o_lora_rank": d.o_lora_rank,
        "sliding_window": cfg.sliding_window,
        "compress_ratios": [0] * cfg.num_layers,
        "compress_rope_theta": cfg.rope_theta,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": 8192,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_shared_experts": moe.num_shared_experts,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": True,
        "swiglu_limit": moe.swiglu_limit,
        "hc_mult": cfg.mhc_streams,
        "hc_sinkhorn_iters": cfg.mhc_sinkhorn_iters,
        "hc_eps": d.hc_eps,
        **UNUSED_BY_THE_DRAFTER,
        "dspark_block_size": cfg.block_size,
        "dspark_target_layer_ids": [int(k) - 1 for k in cfg.target_layers],  # DeepSeek counts layer outputs
        "dspark_noise_token_id": cfg.mask_token_id,
        "torch_dtype": "float32",
    }


def deepseek_tensors(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The drafter's `mtp.<stage>.*` tensors: F32, the routed experts as MXFP4 weight + scale pairs."""
    out: dict[str, torch.Tensor] = {}
    for key, t in export_state(state, "deepseek", num_layers).items():
        if ".ffn.experts." in key:
            packed, scale = mxfp4_pack(t.detach().float().numpy())
            out[key] = torch.from_numpy(packed).view(torch.int8)
            out[key.removesuffix(".weight") + ".scale"] = torch.from_numpy(scale).view(torch.float8_e8m0fnu)
        else:
            out[key] = t.detach().float().contiguous()
    return out


def write_deepseek_checkpoint(export_dir: str | Path, out_dir: str | Path, num_hidden_layers: int) -> Path:
    """Write `export_dir` (a dsv4 draft in our format) as a DeepSeek-V4 checkpoint directory (replaced whole, or
    left as it was on an error); ValueError / FileNotFoundError (one line) for a draft it cannot hold."""
    cfg, state, _ = read_export(export_dir)
    config = deepseek_config(cfg, num_hidden_layers)
    check_target_layers(cfg, num_hidden_layers, hc_mult=int(config["hc_mult"]))
    return write_export_dir(out_dir, deepseek_tensors(state, cfg.num_layers),
                            {"config.json": json.dumps(config, indent=2) + "\n"}, metadata={"format": "pt"})


# the hyper-parameters a drafter shares with the DeepSeek-V4 checkpoint it joins: engines build the drafter's
# stages from the target's config (llama.cpp's converter writes them as the drafter GGUF's keys)
SHARED_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "rms_norm_eps",
               "rope_theta", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
               "scoring_func", "routed_scaling_factor", "norm_topk_prob", "swiglu_limit", "hc_mult",
               "hc_sinkhorn_iters", "hc_eps")
DRAFTER_FILE = "model-dspark-drafter.safetensors"


def merge_into_checkpoint(export_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    """The DeepSeek-V4 checkpoint in `target_dir` with the drafter of `export_dir` added, as `out_dir`: the target's
    files linked (not copied), its config.json plus the `dspark_*` keys, the drafter's `mtp.<stage>.*` tensors in
    one more shard listed in the index. ValueError naming the first shared hyper-parameter the drafter does not
    have (engines build its stages from the target's config), or a target that already holds `mtp.*` tensors."""
    cfg, state, _ = read_export(export_dir)
    src = Path(target_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src} has no config.json: not a model checkpoint directory")
    target = json.loads((src / "config.json").read_text())
    if "DeepseekV4ForCausalLM" not in (target.get("architectures") or []):
        raise ValueError(f"{src}/config.json: architectures {target.get('architectures')}; the drafter joins a "
                         "DeepseekV4ForCausalLM checkpoint (write a standalone one with --format deepseek-v4)")
    ours = deepseek_config(cfg, target["num_hidden_layers"])
    for k in cfg.target_layers:  # hidden states 1..L-1: what vLLM's DeepSeek-V4 hands its DSpark drafter
        if not 0 <= k <= target["num_hidden_layers"]:
            raise ValueError(f"the drafter reads target layer {k}; {src} has {target['num_hidden_layers']} layers "
                             "(it was trained for another target)")
    check_target_layers(cfg, int(target["num_hidden_layers"]), int(ours["hc_mult"]))
    for key in SHARED_KEYS:
        theirs = target.get(key)
        same = theirs == ours[key] or (isinstance(theirs, float) and isinstance(ours[key], float)
                                       and abs(theirs - ours[key]) <= 1e-9 * max(1.0, abs(theirs)))
        if not same:
            raise ValueError(f"the drafter's {key} is {ours[key]!r}, the target's config.json says {theirs!r}: "
                             "engines build the drafter from the target's config, so they must be equal")
    weight_map = safetensors_weight_map(src)
    if clash := sorted(k for k in weight_map if k.startswith("mtp.")):
        raise ValueError(f"{src} already holds mtp.* tensors ({clash[0]}, ... {len(clash)}: its own MTP module or "
                         "drafter); remove them from the checkpoint first")
    tensors = deepseek_tensors(state, cfg.num_layers)
    config = {**target, **{k: ours[k] for k in ("dspark_block_size", "dspark_target_layer_ids",
                                                 "dspark_noise_token_id")}}

    index = {"metadata": {}, "weight_map": {**weight_map, **{k: DRAFTER_FILE for k in tensors}}}
    return write_export_dir(out_dir, tensors, {"config.json": json.dumps(config, indent=2) + "\n",
                                               INDEX: json.dumps(index, indent=2) + "\n"},
                            metadata={"format": "pt"}, weights_file=DRAFTER_FILE,
                            links={f.name: f.resolve() for f in src.iterdir()
                                   if f.name not in ("config.json", INDEX, DRAFTER_FILE)})
