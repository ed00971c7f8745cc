"""A trained v4-deepseek draft (our export format) as llama.cpp's DSV4 draft GGUF (serving/dsv4_gguf_export.py,
`launch/export_draft.py --format gguf-dsv4`): every GGUF hyper-parameter derived from the DraftConfig, the tensors
read back equal to the export's (the routed experts and W2 transposed), the CLI's refusals, the end-of-run log line,
and llama.cpp b11434 loading the export of a draft of launch/configs/v4-deepseek.yaml's shape on SmolLM2 (D 576) and
drafting γ tokens a round with it. Random weights: the faithfulness of a trained one is bench/serve_llamacpp.py
--preset v4-deepseek's.

The llama.cpp test needs the build (python bench/llamacpp.py build); without it that one test is skipped.
Run: python -m pytest tests/test_dsv4_gguf_export.py -q
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields, replace
from pathlib import Path

import gguf
import llamacpp
import numpy as np
import pytest
import torch
from launch_helpers import REPO

from draft_model.config import DraftConfig, DSV4Config, MoEConfig
from pipeline.config import load_config
from serving.dsv4_gguf_export import dsv4_draft_config
from serving.engine_export import NotServable, check_servable

V_SMOL, D_SMOL = 49152, 576


def _odd_cfg() -> DraftConfig:
    """A resolved dsv4 config whose every mapped value is distinct from the others and from the defaults."""
    base = load_config(REPO / "launch" / "configs" / "v4-deepseek.yaml").draft
    cfg = replace(base, mask_token_id=7, num_layers=2, num_heads=6, head_dim=48, block_size=6, sliding_window=37,
                  target_layers=[3, 11], rms_norm_eps=2e-6, rope_theta=12345.0, mhc_sinkhorn_iters=9,
                  moe=MoEConfig(num_experts=5, top_k=3, num_shared_experts=2, expert_intermediate_size=40,
                                score_func="sqrtsoftplus", routed_scaling_factor=1.75, swiglu_limit=7.5),
                  dsv4=DSV4Config(q_lora_rank=33, rope_head_dim=14, o_groups=3, o_lora_rank=21, hc_eps=3e-6))
    return cfg.resolved_for_target(vocab_size=97, hidden_size=64, num_target_layers=12)


def test_gguf_config_derives_every_value_from_the_draft_config():
    cfg = _odd_cfg()
    g = dsv4_draft_config(cfg)
    want = dict(hidden_size=64, num_layers=2, num_heads=6, head_dim=48, qk_rope_head_dim=14, q_lora_rank=33,
                o_groups=3, o_lora_rank=21,
                sliding_window=38,  # W + 1: llama.cpp's key p0 is visible to the query at p1 iff p1 - p0 < n_swa
                num_experts=5, num_experts_per_tok=3, moe_intermediate_size=40, num_shared_experts=2, block_size=6,
                target_layers=(3, 11), mask_token_id=7, routed_scaling_factor=1.75, norm_topk_prob=True,
                swiglu_limit=7.5, hc_mult=4, hc_sinkhorn_iters=9, hc_eps=3e-6, rms_norm_eps=2e-6,
                rope_theta=12345.0, context_length=8192, sample_from_anchor=True)
    assert {f.name for f in fields(g)} == set(want)  # a new key must be mapped here too
    assert asdict(g) == want
    with pytest.raises(ValueError, match="arch 'dsv4' drafts .* draft.arch='dspark'"):
        dsv4_draft_config(replace(cfg, arch="dspark"))
    with pytest.raises(ValueError, match="never resolved against a target"):
        dsv4_draft_config(replace(cfg, mask_token_id=-1))
    # the deepspec/speculators writers point a dsv4 draft at this export instead of calling it a baseline
    with pytest.raises(NotServable, match="--format gguf-dsv4 --target-gguf"):
        check_servable(cfg, "deepspec")


def _smollm2_export(tmp_path: Path, export) -> tuple[Path, dict[str, torch.Tensor]]:
    """An export of launch/configs/v4-deepseek.yaml's draft resolved on SmolLM2 (random, non-trivial weights;
    `export`: the export_random_dsv4 fixture)."""
    run = load_config(REPO / "launch" / "configs" / "v4-deepseek.yaml")
    cfg = replace(run.draft, mask_token_id=3).resolved_for_target(V_SMOL, D_SMOL, 30)
    return tmp_path / "export", export(cfg, tmp_path / "export")


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    if not llamacpp.binary("llama-speculative-simple").is_file():
        pytest.skip("llama.cpp not built (python bench/llamacpp.py build)")
    return llamacpp.target_gguf("smollm2")


def test_trained_shape_export_loads_in_llama_cpp_and_drafts_gamma_tokens(tmp_path, smollm2_gguf, export_cli,
                                                                          export_random_dsv4):
    from serve_llamacpp import parse_rounds, speculative_simple

    export, state = _smollm2_export(tmp_path, export_random_dsv4)
    out = tmp_path / "draft.gguf"
    assert export_cli([str(export.parent), "--format", "gguf-dsv4", "--target-gguf", str(smollm2_gguf),
                        "--out", str(out)]) == 0
    r = gguf.GGUFReader(str(out))
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert (kv["dflash.attention.sliding_window"], kv["dflash.block_size"], kv["dflash.target_layers"],
            kv["dflash.expert_weights_scale"], kv["dflash.swiglu_clamp_exp"]) == (129, 5, [29], 1.5, [10.0])
    back = {t.name: np.asarray(t.data).reshape([int(x) for x in reversed(t.shape)]) for t in r.tensors}
    # the transposed ones: experts [E, D, I] -> [E, I, D], W2 [R, V] -> [V, R]; the rest copies
    assert np.array_equal(back["blk.0.ffn_gate_exps.weight"], state["layers.0.ffn.w_gate_EDI"].transpose(1, 2).numpy())
    assert np.array_equal(back["blk.0.ffn_down_exps.weight"], state["layers.0.ffn.w_down_EID"].transpose(1, 2).numpy())
    assert np.array_equal(back["markov_w2.weight"], state["head.w2_RV"].t().numpy())
    assert np.array_equal(back["blk.0.exp_probs_b.bias"], state["layers.0.ffn.router_bias_E"].numpy())
    assert np.array_equal(back["blk.0.attn_output_a.weight"].reshape(state["layers.0.attn.wo_a.weight"].shape),
                          state["layers.0.attn.wo_a.weight"].numpy())

    res = speculative_simple(smollm2_gguf, out, "def fibonacci(n):", 5, 0.0, 12, ctx=256)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert "DFlash extract_layers = [29]" in log
    assert "DFlash with DSpark markov head (rank = 64)" in log
    assert "block_size=5, mask_token_id=3, n_extract=1, sample_from_anchor=true" in log
    assert "resolving fused DeepSeek V4 HC support" in log
    blocks = [b for _, b in parse_rounds(log)]
    assert len(blocks) >= 2 and all(len(b) == 5 and all(0 <= t < V_SMOL for t in b) for b in blocks), blocks


def test_cli_refusals_are_one_error_line(tmp_path, capsys, export_cli, export_random_dsv4):
    export, _ = _smollm2_export(tmp_path, export_random_dsv4)
    args = [str(export), "--format", "gguf-dsv4", "--out", str(tmp_path / "d.gguf")]
    cases = [(args, "needs --target-gguf"),
             ([*args, "--target-gguf", str(tmp_path / "none.gguf")], "none.gguf does not exist"),
             ([str(tmp_path / "nothing"), *args[1:], "--target-gguf", "x.gguf"], "neither an exported draft")]
    meta = json.loads((export / "config.json").read_text())
    meta["draft"]["arch"] = "dspark"
    (tmp_path / "dspark").mkdir()
    (tmp_path / "dspark" / "config.json").write_text(json.dumps(meta))
    (tmp_path / "dspark" / "model.safetensors").write_bytes((export / "model.safetensors").read_bytes())
    cases.append(([str(tmp_path / "dspark"), *args[1:], "--target-gguf", "x.gguf"], "draft.arch='dspark'"))
    for argv, match in cases:
        assert export_cli(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and match in err, err
    assert not (tmp_path / "d.gguf").exists()


def test_end_of_run_without_a_target_directory_says_why_and_names_the_gguf_command(tmp_path, caplog,
                                                                                   export_random_dsv4):
    import logging

    from serving.engine_export import export_servable

    export, _ = _smollm2_export(tmp_path, export_random_dsv4)
    log = logging.getLogger("t.dsv4")
    with caplog.at_level(logging.INFO, logger="t.dsv4"):
        written = export_servable(export, tmp_path / "run", tmp_path / "no-target", "smollm2", log)
    assert written == {} and len(caplog.records) == 2  # with a target: tests/test_deepseek_checkpoint.py
    assert caplog.records[0].message.startswith("no deepseek-v4 export: target ") and "no config.json" in caplog.text
    assert f"launch/export_draft.py {tmp_path / 'run'} --format gguf-dsv4" in caplog.records[1].message
