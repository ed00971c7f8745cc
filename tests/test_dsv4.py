"""Arch "dsv4" (draft_model/dsv4.py, preset v4-deepseek) is DeepSeek-V4's drafter block: its forward equals an
independent plain re-implementation written from the engines' sources (tests/dsv4_reference.py, fed through the
module's DeepSeek-name export) to 1e-5 in fp32 on random weights with non-zero sinks, router biases, dynamic
hyper-connection mixing and a window shorter than the sequence; gradients reach every trained tensor; the preset
validates and refuses what the engines cannot serve; the GGUF names are llama.cpp's DSV4 loader's; it trains a few
steps through the single-process trainer on the tiny MoE target.

Run: python -m pytest tests/test_dsv4.py -q     (about 20 s on an idle 2-core machine; 7 tests)
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import dsv4_reference as ref
import pytest
import torch
from draft_fixtures import MASK_ID, make_batch
from launch_helpers import REPO, TINY_MOE

from draft_model import build_draft, draft_preset
from draft_model.config import DraftConfig, DSV4Config, MoEConfig
from draft_model.dsv4 import export_state
from draft_model.loss import draft_loss

V, D = 96, 32


def tiny_cfg(**overrides) -> DraftConfig:
    cfg = replace(draft_preset("v4-deepseek"), vocab_size=V, hidden_size=D, num_layers=2, block_size=4,
                  num_heads=4, head_dim=16, sliding_window=5, head_rank=16, target_layers=[1, 2],
                  mask_token_id=MASK_ID,
                  moe=MoEConfig(num_experts=4, top_k=2, num_shared_experts=1, expert_intermediate_size=24,
                                score_func="sqrtsoftplus", routed_scaling_factor=1.5,
                                swiglu_limit=0.5),  # small, so that the clamp binds on these random weights
                  dsv4=DSV4Config(q_lora_rank=24, rope_head_dim=8, o_groups=2, o_lora_rank=12))
    return replace(cfg, **overrides)


def randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every tensor random and non-trivial: sinks, router biases, hyper-connection scales and bases, norms, W2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("_scale"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("norm.weight", "_base")):
                t.copy_(1.0 + torch.randn(t.shape, generator=g) * 0.3)
            elif name.endswith(("attn_sink", "router_bias_E")):
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    return model


def frozen(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g) * 0.5, torch.randn(V, D, generator=g) * D ** -0.5


def reference_hp(cfg: DraftConfig) -> dict:
    return dict(stages=list(range(cfg.num_layers)), block_size=cfg.block_size, sliding_window=cfg.sliding_window,
                rms_norm_eps=cfg.rms_norm_eps, hc_eps=cfg.dsv4.hc_eps, hc_sinkhorn_iters=cfg.mhc_sinkhorn_iters,
                num_heads=cfg.num_heads, head_dim=cfg.head_dim, rope_head_dim=cfg.dsv4.rope_head_dim,
                rope_theta=cfg.rope_theta, o_groups=cfg.dsv4.o_groups, top_k=cfg.moe.top_k,
                routed_scaling_factor=cfg.moe.routed_scaling_factor, swiglu_limit=cfg.moe.swiglu_limit,
                noise_token_id=cfg.mask_token_id)


# sequences of 23 and 11 tokens; anchors before, at and past the window (5), and at 0 (no context)
SEQS, BLOCKS = [23, 11], [(0, 0), (0, 3), (0, 5), (0, 12), (0, 19), (1, 2), (1, 9)]


def test_forward_equals_the_reference_re_implementation():
    cfg = tiny_cfg()
    embed, lm_head = frozen()
    model = randomised(build_draft(cfg, embed, lm_head)).eval()
    batch = make_batch(SEQS, BLOCKS, cfg.block_size, feat_width=2 * D, vocab=V, hidden=D)
    with torch.no_grad():
        out = model(batch)
        logits_NKV = out.hidden_NKD @ lm_head.t() + out.head_factor_NKR @ model.head_w2()
        w = export_state(model.state_dict(), "deepseek", cfg.num_layers)
        prev_NK, anchors = batch.prev_tokens_NK(), batch.anchor_ids_N()
        starts = batch.seq_start_S1.tolist()
        for n, (s, p) in enumerate(BLOCKS):
            feats = batch.ctx_feats_TF[starts[s]:starts[s] + p]
            want = ref.draft_block(w, reference_hp(cfg), embed, lm_head, feats, int(anchors[n]),
                                   prev_NK[n].tolist())
            torch.testing.assert_close(out.hidden_NKD[n], want["hidden"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logits_NKV[n], want["logits"], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.conf_logit_NK[n], want["conf"], rtol=1e-5, atol=1e-5)
        # the check is not vacuous: the reference under llama.cpp's per-slot window differs where the window binds
        n = BLOCKS.index((0, 12))
        slid = ref.draft_block(w, reference_hp(cfg), embed, lm_head, batch.ctx_feats_TF[:12], int(anchors[n]),
                               prev_NK[n].tolist(), llamacpp_window=True)
        assert (slid["hidden"][1:] - out.hidden_NKD[n, 1:]).abs().max() > 1e-3


def test_draft_block_matches_the_training_forward_on_the_teacher_path():
    """Greedy draft_block's tokens are the argmax of the training forward's logits when the Markov head reads them;
    its confidence logits are the forward's on that path (the pre-norm state, no bias)."""
    cfg = tiny_cfg()
    embed, lm_head = frozen()
    model = randomised(build_draft(cfg, embed, lm_head), seed=3).eval()
    blocks = [(0, 0), (0, 5), (0, 12), (0, 19), (1, 2)]  # none overlaps another's slots
    batch = make_batch(SEQS, blocks, cfg.block_size, feat_width=2 * D, vocab=V, hidden=D)
    tokens_NK, probs_NKV, conf_NK = model.draft_block(batch, temperature=0.0)
    ids = batch.input_ids_T.clone()
    starts = batch.seq_start_S1.tolist()
    for n, (s, p) in enumerate(blocks):  # write the drafted tokens in as the continuation (where the sequence has room)
        for k in range(cfg.block_size):
            if p + k + 1 < SEQS[s]:
                ids[starts[s] + p + k + 1] = tokens_NK[n, k]
    teacher = replace(batch, input_ids_T=ids)
    with torch.no_grad():
        out = model(teacher)
    logits = out.hidden_NKD @ lm_head.t() + out.head_factor_NKR @ model.head_w2()
    valid = batch.valid_NK
    assert torch.equal(logits.argmax(-1)[valid], tokens_NK[valid])
    torch.testing.assert_close(conf_NK[valid], out.conf_logit_NK[valid], rtol=1e-5, atol=1e-5)
    assert torch.allclose(probs_NKV.sum(-1), torch.ones(()))


def test_shapes_and_gradients_reach_every_trained_tensor():
    cfg = tiny_cfg()
    embed, lm_head = frozen()
    model = build_draft(cfg, embed, lm_head)
    batch = make_batch(SEQS, BLOCKS, cfg.block_size, feat_width=2 * D, vocab=V, hidden=D)
    out = model(batch)
    N, K = len(BLOCKS), cfg.block_size
    assert out.hidden_NKD.shape == (N, K, D) and out.head_factor_NKR.shape == (N, K, cfg.head_rank)
    assert out.conf_logit_NK.shape == (N, K) and out.aux_loss.shape == ()
    draft_loss(model, batch, _loss_cfg()).total().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert not any(n.startswith("frozen") for n in model.state_dict())


def _loss_cfg():
    from draft_model.config import LossConfig
    return LossConfig(matmul_dtype="float32")


def test_preset_fits_smollm2_and_refuses_what_the_engines_cannot_serve():
    cfg = draft_preset("v4-deepseek")
    assert (cfg.arch, cfg.block_size, cfg.num_layers, cfg.mhc_streams, cfg.sliding_window) == ("dsv4", 5, 3, 4, 128)
    assert cfg.target_layers == [29] and draft_preset("v4-deepseek", 3).target_layers == [2]
    assert draft_preset("v4").arch == "dspark"  # the research variant is unchanged
    embed = torch.randn(200, 576)
    model = build_draft(replace(cfg, mask_token_id=3), embed, embed)
    assert model.cfg.hidden_size == 576
    assert 45e6 < sum(p.numel() for p in model.parameters()) < 60e6  # MoE 3 x 8 x 3 x 576 x 1024 dominates
    resolved = replace(cfg, mask_token_id=3).resolved_for_target(200, 576, 30)
    assert resolved.dsv4 == cfg.dsv4
    with pytest.raises(ValueError, match="layer inputs 0..29"):
        replace(cfg, target_layers=[30]).resolved_for_target(200, 576, 30)
    for bad, match in [(dict(target_layers=[-1]), "not the final state"), (dict(num_kv_heads=2), "num_kv_heads=1"),
                       (dict(mhc_streams=2), "mhc_streams=4"), (dict(sliding_window=0), "sliding_window > 0"),
                       (dict(mask="learned"), "mask='token'"), (dict(head="rnn"), "Markov head or none"),
                       (dict(moe=replace(cfg.moe, score_func="sigmoid")), "sqrtsoftplus"),
                       (dict(num_heads=9), "multiple of draft.dsv4.o_groups"),
                       (dict(dsv4=replace(cfg.dsv4, rope_head_dim=256)), "at most the head dim")]:
        with pytest.raises(ValueError, match=match):
            replace(cfg, **bad).validate()


def test_engine_names_are_llama_cpps_dsv4_tensors():
    """Every tensor maps; the GGUF names and (reversed) shapes are the ones dflash.cpp's DSV4 loader creates."""
    cfg = tiny_cfg(num_layers=2)
    model = build_draft(cfg, *frozen())
    gguf = export_state(model.state_dict(), "gguf", cfg.num_layers)
    H, E, G, Ro, Q, I, n = 4, 16, 2, 12, 24, 24, 4
    want = {"fc.weight": (D, 2 * D), "enc.output_norm.weight": (D,), "output_norm.weight": (D,),
            "output_hc_fn.weight": (n, n * D), "output_hc_base.weight": (n,), "output_hc_scale.weight": (1,),
            "markov_w1.weight": (V, 16), "markov_w2.weight": (V, 16), "conf_proj.weight": (1, D + 16)}
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        want.update({b + "attn_norm.weight": (D,), b + "attn_sinks.weight": (H,), b + "attn_q_a.weight": (Q, D),
                     b + "attn_q_a_norm.weight": (Q,), b + "attn_q_b.weight": (H * E, Q), b + "attn_kv.weight": (E, D),
                     b + "attn_kv_a_norm.weight": (E,), b + "attn_output_a.weight": (G * Ro, H * E // G),
                     b + "attn_output_b.weight": (D, G * Ro), b + "ffn_norm.weight": (D,),
                     b + "ffn_gate_inp.weight": (4, D), b + "exp_probs_b.bias": (4,),
                     b + "ffn_gate_exps.weight": (4, I, D), b + "ffn_up_exps.weight": (4, I, D),
                     b + "ffn_down_exps.weight": (4, D, I), b + "ffn_gate_shexp.weight": (I, D),
                     b + "ffn_up_shexp.weight": (I, D), b + "ffn_down_shexp.weight": (D, I)})
        for part in ("attn", "ffn"):
            want.update({f"{b}hc_{part}_fn.weight": ((2 + n) * n, n * D), f"{b}hc_{part}_base.weight": ((2 + n) * n,),
                         f"{b}hc_{part}_scale.weight": (3,)})
    assert {k: tuple(v.shape) for k, v in gguf.items()} == want
    sd = model.state_dict()
    assert torch.equal(gguf["blk.1.ffn_gate_exps.weight"], sd["layers.1.ffn.w_gate_EDI"].transpose(1, 2))
    assert torch.equal(gguf["markov_w2.weight"], sd["head.w2_RV"].t())
    deepseek = export_state(sd, "deepseek", cfg.num_layers)
    assert "mtp.0.main_proj.weight" in deepseek and "mtp.1.confidence_head.proj.weight" in deepseek
    assert deepseek["mtp.0.ffn.experts.3.w2.weight"].shape == (D, I)


def test_trains_through_the_single_process_trainer(tmp_path):
    """v4-deepseek, shrunk, trains 3 steps on the tiny MoE target (hidden 64, 3 layers; context = the last layer's
    input, index 2) with finite losses, and its export loads back as arch dsv4."""
    from pipeline.config import load_config
    from pipeline.export import load_exported_draft
    from pipeline.metrics import read_jsonl_metrics
    from workers.frozen_target.model import embedding_weights, load_target, resolve_target_path
    from workers.trainer.single_process import train_single_process

    run_dir = tmp_path / "dsv4"
    overrides = [a for a in TINY_MOE if not a.startswith("draft.num_kv_heads")]
    cfg = load_config(REPO / "launch" / "configs" / "tiny.yaml",
                      [*overrides, "draft.preset=v4-deepseek", "draft.num_layers=1", "draft.num_kv_heads=1",
                       "draft.mhc_streams=4", "draft.target_layers=[2]", "draft.sliding_window=16",
                       "draft.dsv4.q_lora_rank=16", "draft.dsv4.rope_head_dim=8", "draft.dsv4.o_lora_rank=16",
                       "draft.moe.expert_intermediate_size=32", "draft.head_rank=16", "train.max_steps=3",
                       "data.num_samples=16", f"checkpoint.run_dir={run_dir}"])
    export = train_single_process(cfg, logging.getLogger("test"), device="cpu")
    rows = read_jsonl_metrics(run_dir / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3] and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in rows.values())
    target, _ = load_target(resolve_target_path("tiny-qwen3-moe"))
    draft = load_exported_draft(export, *embedding_weights(target))
    assert draft.cfg.arch == "dsv4" and draft.cfg.target_layers == [2]


def test_launch_config_resolves_on_smollm2():
    """launch/configs/v4-deepseek.yaml keeps DeepSeek's fixed forms and reads SmolLM2's last layer input (29 < 30)."""
    from pipeline.config import load_config

    cfg = load_config(REPO / "launch" / "configs" / "v4-deepseek.yaml")
    d = cfg.draft
    assert (d.arch, d.num_kv_heads, d.mhc_streams, d.moe.score_func, d.mask, d.target_layers) == \
        ("dsv4", 1, 4, "sqrtsoftplus", "token", [29])
    d.resolved_for_target(vocab_size=49152, hidden_size=576, num_target_layers=30)
