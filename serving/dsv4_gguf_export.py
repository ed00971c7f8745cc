"""A trained v4-deepseek draft (arch "dsv4", our export format: <run>/export) as the GGUF llama.cpp b11434 serves.

    from serving.dsv4_gguf_export import write_export_gguf
    write_export_gguf("runs/v4-deepseek/export", "draft.gguf", "smollm2-135m-f32.gguf")

Three steps, each owned elsewhere: `dsv4_draft_config` maps our DraftConfig onto the GGUF's hyper-parameters (every
value derived from it; the two conventions where llama.cpp and our module differ are applied here and nowhere
else), `draft_model.dsv4.export_state` renames the tensors to llama.cpp's names, and
`serving.gguf_dsv4.write_dsv4_gguf` writes the file with the target's facts read from the target's own GGUF (its
width, depth and tokenizer, which llama.cpp checks against the target it serves). The same command line:
`python launch/export_draft.py RUN --format gguf-dsv4 --target-gguf TARGET.gguf --out draft.gguf`.
"""

from __future__ import annotations

from pathlib import Path

from draft_model.config import DraftConfig
from draft_model.dsv4 import export_state
from pipeline.export import read_export
from serving.gguf_dsv4 import DSV4DraftConfig, TargetFacts, write_dsv4_gguf


def require_resolved_dsv4(cfg: DraftConfig, holder: str) -> None:
    """ValueError unless `cfg` is an arch-"dsv4" draft resolved against its target; `holder` names the format."""
    if cfg.arch != "dsv4":
        raise ValueError(f"the {holder} holds arch 'dsv4' drafts (preset v4-deepseek), this one is "
                         f"draft.arch={cfg.arch!r}")
    if cfg.mask_token_id < 0 or not cfg.vocab_size:
        raise ValueError(f"the draft config was never resolved against a target (mask_token_id {cfg.mask_token_id}, "
                         f"vocab_size {cfg.vocab_size})")


def dsv4_draft_config(cfg: DraftConfig) -> DSV4DraftConfig:
    """The GGUF hyper-parameters of a resolved arch-"dsv4" DraftConfig. ValueError for any other arch."""
    require_resolved_dsv4(cfg, "DeepSeek-V4 drafter GGUF")
    d, moe = cfg.dsv4, cfg.moe
    return DSV4DraftConfig(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        head_dim=cfg.resolved_head_dim, qk_rope_head_dim=d.rope_head_dim, q_lora_rank=d.q_lora_rank,
        o_groups=d.o_groups, o_lora_rank=d.o_lora_rank,
        # llama.cpp: key p0 is visible to the query at p1 iff p1 - p0 < n_swa. W + 1 gives slot 0 (the anchor, at
        # p) exactly our window [p - W, p); later slots lose their oldest keys (docs/dsv4.md, departure 1)
        sliding_window=cfg.sliding_window + 1,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_intermediate_size,
        num_shared_experts=moe.num_shared_experts, block_size=cfg.block_size,
        target_layers=tuple(int(k) for k in cfg.target_layers),  # llama.cpp's index = our HF index (layer k's input)
        mask_token_id=cfg.mask_token_id, routed_scaling_factor=moe.routed_scaling_factor,
        norm_topk_prob=moe.score_func != "softmax",  # moe.py renormalises the top-k of sigmoid/sqrt-softplus
        swiglu_limit=moe.swiglu_limit, hc_mult=cfg.mhc_streams, hc_sinkhorn_iters=cfg.mhc_sinkhorn_iters,
        hc_eps=d.hc_eps, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, sample_from_anchor=True)


def write_export_gguf(export_dir: str | Path, out: str | Path, target_gguf: str | Path, dtype: str = "f32") -> Path:
    """Write `export_dir` (a dsv4 draft in our format) as a llama.cpp draft GGUF for the target in `target_gguf`;
    ValueError / FileNotFoundError (one line) for anything llama.cpp would refuse or mis-serve."""
    cfg, state, _ = read_export(export_dir)
    gcfg = dsv4_draft_config(cfg)
    if not Path(target_gguf).is_file():
        raise FileNotFoundError(f"target GGUF {target_gguf} not found (convert the target with llama.cpp's "
                                "convert_hf_to_gguf.py)")
    facts = TargetFacts.from_gguf(target_gguf)
    if facts.vocab_size != cfg.vocab_size:
        raise ValueError(f"the target GGUF's vocabulary has {facts.vocab_size} tokens, the draft was trained on "
                         f"{cfg.vocab_size}: not its target")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        write_dsv4_gguf(tmp, export_state(state, "gguf", cfg.num_layers), gcfg, facts, dtype=dtype)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
