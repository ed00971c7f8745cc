"""Named draft configurations. vocab/hidden size stay 0 and are filled from the target at build time
(`DraftConfig.resolved_for_target`); tests shrink a preset with `dataclasses.replace`.

Head geometry (32 query heads, 8 KV heads, head dim 128) follows the Qwen3/DFlash drafts; since head_dim is
explicit, the presets fit any target hidden size.
"""

from __future__ import annotations

from collections.abc import Callable

from draft_model.config import FINAL_HIDDEN, DraftConfig, DSV4Config, MoEConfig, evenly_spaced_layers

_ATTN = dict(num_heads=32, num_kv_heads=8, head_dim=128)
# the forms the engines' DFlash/DSpark layers implement (per-head q/k norm, mask slot = a token's frozen embedding):
# the dense DSpark presets take them so that what they train exports exactly (pipeline/engine_export.py)
_SERVABLE = dict(qk_norm=True, mask="token")


def _dflash() -> DraftConfig:
    # DFlash proper uses 16-token blocks; we use γ = 7 (the DSpark paper's setting) so that acceptance numbers
    # are comparable with the dspark presets. Dense, full attention, no sequential head, confidence kept.
    return DraftConfig(arch="dspark", block_size=7, num_layers=5, ffn="dense", residual="plain",
                       sliding_window=0, head="none", confidence=True, **_ATTN, **_SERVABLE)


def _dspark_markov() -> DraftConfig:
    return DraftConfig(arch="dspark", block_size=7, num_layers=2, ffn="dense", residual="plain",
                       sliding_window=0, head="markov", head_rank=256, confidence=True, **_ATTN, **_SERVABLE)


def _dspark_rnn() -> DraftConfig:
    return DraftConfig(arch="dspark", block_size=7, num_layers=2, ffn="dense", residual="plain",
                       sliding_window=0, head="rnn", head_rank=256, rnn_state_size=256, confidence=True, **_ATTN,
                       **_SERVABLE)


def _v4() -> DraftConfig:
    # DSpark-V4 production draft: 3 MoE layers, mHC residual streams, SWA 128, γ = 5, Markov head r = 256, fed
    # with the target's final pre-LM-head state only.
    return DraftConfig(arch="dspark", block_size=5, num_layers=3, ffn="moe",
                       moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate_size=1024),
                       residual="mhc", mhc_streams=4, mhc_sinkhorn_iters=20, sliding_window=128,
                       head="markov", head_rank=256, confidence=True, target_layers=[FINAL_HIDDEN], **_ATTN)


def _v4_deepseek() -> DraftConfig:
    # DeepSeek-V4's own drafter block (draft_model/dsv4.py), the MoE + hyper-connection draft the engines serve:
    # 3 stages, hc_mult 4 with 20 Sinkhorn iterations, SWA 128 on every stage, γ = 5, Markov r = 256 + confidence,
    # sqrt-softplus router over 8 experts (top 2) + 1 shared, I = 1024 (v4's MoE, so the two compare at about the
    # same FFN budget), with DeepSeek-V4's routed_scaling_factor 1.5 and SwiGLU clamp 10. Attention at
    # DeepSeek-V4-Flash's proportions scaled to a 576-wide target (SmolLM2-135M): 8 query heads of 128 over one
    # shared K = V head, the last 64 dims rotated (V4's qk_rope_head_dim), q-LoRA 256, 2 output groups of 4 heads
    # each through rank 256. head_dim is explicit, so it fits any hidden size (the tiny MoE targets' 64 too).
    # Context: the input of SmolLM2's last layer (hidden-state index 29 of 0..30): a layer input, which llama.cpp's
    # LLaMA/Qwen3 targets expose (not the final state -1); draft_preset(name, L) takes L - 1 for another depth, and
    # draft.target_layers overrides it.
    return DraftConfig(arch="dsv4", block_size=5, num_layers=3, num_heads=8, num_kv_heads=1, head_dim=128,
                       ffn="moe", moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1,
                                                expert_intermediate_size=1024, score_func="sqrtsoftplus",
                                                routed_scaling_factor=1.5, swiglu_limit=10.0),
                       residual="mhc", mhc_streams=4, mhc_sinkhorn_iters=20, sliding_window=128, head="markov",
                       head_rank=256, confidence=True, mask="token", target_layers=[29],
                       dsv4=DSV4Config(q_lora_rank=256, rope_head_dim=64, o_groups=2, o_lora_rank=256))


def _eagle3() -> DraftConfig:
    # EAGLE-3 baseline (draft_model/eagle3.py): one decoder layer, trained with the training-time test over the
    # same γ = 7 slots; fed low/middle/high target layers when the target depth is known (eagle3_layers).
    return DraftConfig(arch="eagle3", block_size=7, num_layers=1, ffn="dense", residual="plain",
                       sliding_window=0, head="none", confidence=True, **_ATTN)


def _mtp1() -> DraftConfig:
    # MTP-1 baseline: DeepSeek-V3's MTP module shape, i.e. eagle3 at γ = 1 on the target's final state with no
    # fusion Linear (u_j = W_in [norm(embed(x_{j+1})); norm(h_j)] -> one decoder layer -> norm -> frozen head).
    # The confidence head is kept: it costs D + 1 weights, gives MTP-1 the same loss terms as every other drafter
    # and lets the simulator schedule its one slot (verify it or not) like the others'; confidence=False is the
    # pure MTP module.
    return DraftConfig(arch="eagle3", block_size=1, num_layers=1, ffn="dense", residual="plain", sliding_window=0,
                       head="none", confidence=True, target_layers=[FINAL_HIDDEN], fuse_features=False, **_ATTN)


def _draft_lm() -> DraftConfig:
    # Classic separate draft LM (draft_model/draft_lm.py): a 2-layer causal LM over tokens alone, drafting γ = 7
    # tokens one forward each (cost linear in γ); the final state listed is only what the loss's p_t needs.
    return DraftConfig(arch="draft-lm", block_size=7, num_layers=2, ffn="dense", residual="plain",
                       sliding_window=0, head="none", confidence=True, target_layers=[FINAL_HIDDEN], **_ATTN)


def eagle3_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's low/middle/high features: HF hidden-state indices 2, L//2 and L-3, kept inside 1..L for
    shallow (test) targets."""
    L = num_target_layers
    return sorted(min(max(i, 1), L) for i in (2, L // 2, L - 3))


PRESETS: dict[str, Callable[[], DraftConfig]] = {
    "dflash": _dflash,
    "dspark-markov": _dspark_markov,
    "dspark-rnn": _dspark_rnn,
    "v4": _v4,
    "v4-deepseek": _v4_deepseek,
    "eagle3": _eagle3,
    "mtp1": _mtp1,
    "draft-lm": _draft_lm,
}
_MULTI_LAYER_CONTEXT = ("dflash", "dspark-markov", "dspark-rnn")


def draft_preset(name: str, num_target_layers: int | None = None) -> DraftConfig:
    """A fresh DraftConfig for `name`. With `num_target_layers`, the DFlash-style presets take their context from
    one target layer per draft layer, evenly spaced from 1 to L-3 (DFlash's default); without it they read the
    final hidden state only. "eagle3" takes layers 2, L//2 and L-3 (low, middle, high); "v4-deepseek" the last
    layer's input L-1; "mtp1" and "draft-lm" keep the final state [-1] whatever the depth."""
    if name not in PRESETS:
        raise ValueError(f"unknown draft preset {name!r}; valid presets: {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    if num_target_layers is not None and name in _MULTI_LAYER_CONTEXT:
        cfg.target_layers = evenly_spaced_layers(num_target_layers, cfg.num_layers)
    if num_target_layers is not None and name == "eagle3":
        cfg.target_layers = eagle3_layers(num_target_layers)
    if num_target_layers is not None and name == "v4-deepseek":
        cfg.target_layers = [max(num_target_layers - 1, 0)]
    return cfg
