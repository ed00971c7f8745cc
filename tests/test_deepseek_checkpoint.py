"""A v4-deepseek draft in the DeepSeek-V4 checkpoint layout (serving/deepseek_checkpoint.py, `launch/export_draft.py
--format deepseek-v4`, written at the end of every dsv4 run): the MXFP4 packing decoded by an independent reading of
DeepSeek's layout, the config's keys, the refusals, and llama.cpp's own `convert_hf_to_gguf.py --dspark` turning the
directory into a GGUF whose every tensor is, byte for byte, what our direct GGUF writer writes with MXFP4 experts.

The converter test needs llama.cpp's source tree (python bench/llamacpp.py fetch; no C++ build).
Run: python -m pytest tests/test_deepseek_checkpoint.py -q
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import gguf
import llamacpp
import numpy as np
import pytest
import torch
from launch_helpers import REPO
from safetensors import safe_open

from draft_model.config import DSV4Config, MoEConfig
from draft_model.dsv4 import export_state
from pipeline.config import load_config
from pipeline.export import export_draft
from serving.deepseek_checkpoint import deepseek_config, mxfp4_pack, write_deepseek_checkpoint
from serving.dsv4_gguf_export import dsv4_draft_config
from serving.gguf_dsv4 import TargetFacts, write_dsv4_gguf

# OCP MX FP4 (E2M1) code points in code order: sign bit 3, then exponent and mantissa
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _decode_deepseek_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """DeepSeek's layout read as its format says: byte i of a row holds element 2i (low nibble) and 2i + 1 (high);
    every 32 elements share 2^(e - 127)."""
    lo, hi = packed & 0x0F, packed >> 4
    codes = np.stack((lo, hi), axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes] * np.repeat(np.exp2(scale.astype(np.float32) - 127.0), 32, axis=1)


def test_mxfp4_packing_decodes_to_gguf_py_s_quantization():
    g = np.random.default_rng(0)
    w = (g.standard_normal((6, 96)) * np.exp(g.uniform(-4, 4, (6, 1)))).astype(np.float32)  # rows of mixed scale
    packed, scale = mxfp4_pack(w)
    assert packed.shape == (6, 48) and packed.dtype == np.uint8 and scale.shape == (6, 3) and scale.dtype == np.uint8
    got = _decode_deepseek_mxfp4(packed, scale)
    want = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4),
                                  gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - w).max() <= np.abs(w).max() * 0.26  # FP4: within a quarter of a block's largest value
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_pack(np.zeros((2, 40), np.float32))


def _cfg(**over):
    base = load_config(REPO / "launch" / "configs" / "v4-deepseek.yaml").draft
    cfg = replace(base, mask_token_id=5, num_layers=2, num_heads=4, head_dim=32, block_size=4, sliding_window=16,
                  target_layers=[2, 9], head_rank=16,
                  moe=MoEConfig(num_experts=3, top_k=2, num_shared_experts=1, expert_intermediate_size=32,
                                score_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0),
                  dsv4=DSV4Config(q_lora_rank=24, rope_head_dim=16, o_groups=2, o_lora_rank=16))
    return replace(cfg, **over)


def test_config_says_what_the_draft_is_in_deepseek_v4_s_names():
    V, D = 49152, 64
    cfg = _cfg().resolved_for_target(V, D, 12)
    c = deepseek_config(cfg, num_hidden_layers=12)
    assert c["architectures"] == ["DeepseekV4ForCausalLM"] and c["num_hidden_layers"] == 12
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (D, 4, 1, 32)
    assert (c["q_lora_rank"], c["qk_rope_head_dim"], c["o_groups"], c["o_lora_rank"]) == (24, 16, 2, 16)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c["n_shared_experts"]) == \
        (3, 2, 32, 1)
    assert c["scoring_func"] == "sqrtsoftplus" and c["routed_scaling_factor"] == 1.5 and c["swiglu_limit"] == 10.0
    assert c["sliding_window"] == 16  # DeepSeek's W: every slot sees the 16 rows before the anchor
    assert c["hc_mult"] == 4 and c["compress_ratios"] == [0, 0]
    assert c["dspark_block_size"] == 4 and c["dspark_noise_token_id"] == 5
    assert c["dspark_target_layer_ids"] == [1, 8]  # DeepSeek counts layer outputs: our hidden-state index - 1
    with pytest.raises(ValueError, match="draft.arch='dspark'"):
        deepseek_config(replace(cfg, arch="dspark"), 12)
    with pytest.raises(ValueError, match="never resolved"):
        deepseek_config(replace(cfg, mask_token_id=-1), 12)
    with pytest.raises(ValueError, match="expert_intermediate_size=40: MXFP4"):
        deepseek_config(replace(cfg, moe=replace(cfg.moe, expert_intermediate_size=40)), 12)


def _export(tmp_path: Path, export, V: int, D: int, **over) -> tuple[Path, object, dict[str, torch.Tensor]]:
    """`_cfg(**over)` resolved for a target of vocabulary V and width D, exported by `export` (the
    export_random_dsv4 fixture) into tmp_path/export."""
    cfg = _cfg(**over).resolved_for_target(V, D, 12)
    return tmp_path / "export", cfg, export(cfg, tmp_path / "export")


def test_checkpoint_holds_the_mtp_tensors_with_mxfp4_experts(tmp_path, export_random_dsv4):
    export, cfg, state = _export(tmp_path, export_random_dsv4, 97, 64)
    out = write_deepseek_checkpoint(export, tmp_path / "ds", num_hidden_layers=12)
    assert json.loads((out / "config.json").read_text()) == deepseek_config(cfg, 12)
    want = export_state(state, "deepseek", cfg.num_layers)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        experts = {k for k in want if ".ffn.experts." in k}
        assert keys == set(want) | {k.removesuffix(".weight") + ".scale" for k in experts}
        assert all(k.startswith(("mtp.0.", "mtp.1.")) for k in keys)
        for k in set(want) - experts:
            assert torch.equal(f.get_tensor(k), want[k].float()), k
        k = "mtp.1.ffn.experts.2.w2.weight"  # [D, I]: the down projection of the last expert of the last stage
        packed, scale = f.get_tensor(k), f.get_tensor(k.replace(".weight", ".scale"))
        assert packed.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
        got = _decode_deepseek_mxfp4(packed.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy())
        assert np.abs(got - want[k].numpy()).max() <= np.abs(want[k].numpy()).max() * 0.26


def test_end_of_run_writes_the_checkpoint_and_names_the_gguf_command(tmp_path, caplog, export_random_dsv4):
    from serving.engine_export import export_servable

    export, cfg, _ = _export(tmp_path, export_random_dsv4, 97, 64)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 12}))
    log = logging.getLogger("t.dsckpt")
    with caplog.at_level(logging.INFO, logger="t.dsckpt"):
        written = export_servable(export, tmp_path / "run", target, "smollm2", log)
    assert written == {"deepseek-v4": tmp_path / "run" / "export-deepseek-v4"}
    assert json.loads((written["deepseek-v4"] / "config.json").read_text())["num_hidden_layers"] == 12
    assert "DeepSeek-V4 checkpoint" in caplog.records[0].message
    assert f"launch/export_draft.py {tmp_path / 'run'} --format gguf-dsv4" in caplog.records[1].message


def _same_tensors_as_our_mxfp4_gguf(converted: Path, tmp_path: Path, cfg, state, facts):
    """Readers of our direct GGUF (MXFP4 experts) and of `converted`, after asserting the two hold the same tensors:
    the same names, types and bytes."""
    direct = write_dsv4_gguf(tmp_path / "direct.gguf", export_state(state, "gguf", cfg.num_layers),
                             dsv4_draft_config(cfg), facts, mxfp4_experts=True)
    a, b = gguf.GGUFReader(str(direct)), gguf.GGUFReader(str(converted))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert t.tensor_type == tb[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data).ravel(), np.asarray(tb[name].data).ravel()), name
    return a, b


def test_llama_cpp_s_dspark_converter_reads_it_as_our_gguf_with_mxfp4_experts(tmp_path, llama_cpp_tree,
                                                                              export_random_dsv4):
    """DeepSeek's own route, run: the checkpoint through convert_hf_to_gguf.py --dspark. Every tensor equals our
    direct writer's (the routed experts' MXFP4 blocks byte for byte: the converter's repack inverts ours), and so
    does every hyper-parameter but the window: the converter copies DeepSeek's W as llama.cpp's n_swa, ours writes
    W + 1 (docs/dsv4.md, departure 1)."""
    from workers.frozen_target.model import resolve_target_path

    target_dir = resolve_target_path("smollm2")
    V = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    export, cfg, state = _export(tmp_path, export_random_dsv4, V, 64)
    ckpt = write_deepseek_checkpoint(export, tmp_path / "ds", num_hidden_layers=30)
    converted = llamacpp.convert(ckpt, tmp_path / "converted.gguf", target_dir, extra=("--dspark",))
    facts = TargetFacts(arch="llama", hidden_size=64, num_layers=30, vocab_size=V, tokenizer={})
    a, b = _same_tensors_as_our_mxfp4_gguf(converted, tmp_path, cfg, state, facts)
    assert {t.name: t for t in a.tensors}["blk.1.ffn_down_exps.weight"].tensor_type == \
        gguf.GGMLQuantizationType.MXFP4

    def kv(r: gguf.GGUFReader, key: str):
        return r.fields[f"dflash.{key}"].contents()

    for key in ("block_size", "target_layers", "block_count", "attention.head_count", "attention.key_length",
                "attention.q_lora_rank", "rope.dimension_count", "attention.output_group_count",
                "attention.output_lora_rank", "expert_count", "expert_used_count", "expert_feed_forward_length",
                "expert_shared_count", "expert_gating_func", "expert_weights_norm", "hyper_connection.count",
                "hyper_connection.sinkhorn_iterations", "swiglu_clamp_exp"):
        assert kv(a, key) == kv(b, key), key
    for key in ("expert_weights_scale", "rope.freq_base", "attention.layer_norm_rms_epsilon",
                "hyper_connection.epsilon"):
        assert kv(a, key) == pytest.approx(kv(b, key), rel=1e-6), key
    assert kv(b, "target_layers") == [2, 9]  # our hidden-state indices, back from DeepSeek's layer ids
    assert b.fields["tokenizer.ggml.mask_token_id"].contents() == 5
    assert (kv(a, "attention.sliding_window"), kv(b, "attention.sliding_window")) == (17, 16)


def test_cli_writes_it_and_refuses_a_draft_it_cannot_hold_in_one_line(tmp_path, capsys, export_cli, export_random_dsv4):
    export, cfg, _ = _export(tmp_path, export_random_dsv4, 97, 64)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 12}))
    assert export_cli([str(export), "--format", "deepseek-v4", "--out", str(tmp_path / "ds"), "--target",
                       str(target)]) == 0
    assert json.loads((tmp_path / "ds" / "config.json").read_text()) == deepseek_config(cfg, 12)
    capsys.readouterr()
    odd = tmp_path / "odd"  # an expert width MXFP4 cannot hold
    export_draft({}, {"draft": replace(cfg, moe=replace(cfg.moe, expert_intermediate_size=40)).to_dict(),
                      "target": "smollm2"}, odd)
    assert export_cli([str(odd), "--format", "deepseek-v4", "--out", str(tmp_path / "ds2"), "--target",
                       str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "expert_intermediate_size=40" in err, err
    assert not (tmp_path / "ds2").exists()


def _tiny_deepseek_v4_target(out: Path, cfg) -> Path:
    """A random DeepseekV4ForCausalLM built by transformers from a config sharing the drafter's hyper-parameters
    (2 layers), saved with SmolLM2's tokenizer: what a DeepSeek-V4 user's checkpoint directory looks like."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from serving.deepseek_checkpoint import SHARED_KEYS
    from workers.frozen_target.model import smollm2_tokenizer

    shared = {k: v for k, v in deepseek_config(cfg, 2).items() if k in SHARED_KEYS}
    config = DeepseekV4Config(**shared, num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                              mlp_layer_types=["moe"] * 2, num_nextn_predict_layers=0, index_n_heads=2,
                              index_head_dim=16, index_topk=8)
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(config).save_pretrained(str(out))
    smollm2_tokenizer().save_pretrained(str(out))
    return out


def test_merged_into_a_deepseek_v4_target_checkpoint_llama_cpp_converts_the_drafter(tmp_path, llama_cpp_tree,
                                                                                    export_random_dsv4):
    """The drafter added to a (tiny, random) DeepSeek-V4 checkpoint built by transformers, as a DeepSeek-V4 user
    does it: the target's files linked, its config plus the dspark_* keys, our tensors as one more shard; llama.cpp's
    converter, given that directory alone, writes the drafter GGUF our direct writer writes (MXFP4 experts, the
    converter's window W). A shared hyper-parameter that differs is refused by name."""
    from serving.deepseek_checkpoint import merge_into_checkpoint
    from serving.engine_export import NotServable

    V = 49152
    # context layer 1, the first layer's output (the streams' mean): the one a 2-layer V4 target hands a drafter
    export, cfg, state = _export(tmp_path, export_random_dsv4, V, 64, target_layers=[1])
    target = _tiny_deepseek_v4_target(tmp_path / "dsv4-target", cfg)
    merged = merge_into_checkpoint(export, target, tmp_path / "merged")
    conf = json.loads((merged / "config.json").read_text())
    assert conf["dspark_target_layer_ids"] == [0] and conf["dspark_block_size"] == 4
    # our 2 (= L) is the final state after hc_head and the norm; the engines' id L is the streams' mean before them
    final, *_ = _export(tmp_path / "final", export_random_dsv4, V, 64, target_layers=[1, 2])
    with pytest.raises(NotServable, match="holds 2 \\(= num_hidden_layers\\), the target's final state"):
        merge_into_checkpoint(final, target, tmp_path / "merged-final")
    # the standalone layout too (-1 is refused by the dsv4 draft config itself)
    from serving.deepseek_checkpoint import write_deepseek_checkpoint

    with pytest.raises(NotServable, match="holds 2 \\(= num_hidden_layers\\)"):
        write_deepseek_checkpoint(final, tmp_path / "ds-final", num_hidden_layers=2)
    assert (merged / "model.safetensors").is_symlink()  # the target's weights are linked, not copied
    converted = llamacpp.convert(merged, tmp_path / "converted.gguf", merged, extra=("--dspark",))
    facts = TargetFacts(arch="deepseek4", hidden_size=64, num_layers=2, vocab_size=V, tokenizer={})
    _, b = _same_tensors_as_our_mxfp4_gguf(converted, tmp_path, cfg, state, facts)  # none of the target's own
    assert b.fields["dflash.target_layers"].contents() == [1] and b.fields["dflash.block_count"].contents() == 2
    assert b.fields["dflash.attention.sliding_window"].contents() == 16

    # trained on a deeper target's layer 3
    deep, *_ = _export(tmp_path / "deep", export_random_dsv4, V, 64, target_layers=[1, 3])
    with pytest.raises(ValueError, match="target layer 3; .* has 2 layers"):
        merge_into_checkpoint(deep, target, tmp_path / "merged2")
    bad = json.loads((target / "config.json").read_text())
    bad["o_lora_rank"] = 32
    (target / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="drafter's o_lora_rank is 16, the target's config.json says 32"):
        merge_into_checkpoint(export, target, tmp_path / "merged2")
    assert not (tmp_path / "merged2").exists()
