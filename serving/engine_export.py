"""A trained draft in the formats serving engines load: plain JSON + safetensors, no engine imported.

Three formats, the same tensors under the engines' names (docs/serving-export.md, docs/vllm-serving.md):
- "deepspec": the flat Qwen3 DSpark schema of DeepSpec's and z-lab's drafts (`Qwen3DSparkModel`), read by vLLM's
  and SGLang's DSpark loaders and by llama.cpp's converter (`convert_hf_to_gguf.py`, class DSparkModel).
  `target_layer_ids` count decoder-layer outputs (our hidden-state index − 1).
- "speculators": vLLM's speculators schema (`speculators_model_type: dspark`, a Qwen3 `transformer_layer_config`,
  `aux_hidden_state_layer_ids` = our hidden-state indices).
- "dflash": the DFlash schema (`DFlashDraftModel`, `dflash_config`) vLLM serves with method "dflash", the one
  block-parallel method its V1 (CPU) runner runs. Its reader has one block layout, bonus-anchor: a draft trained in
  another is refused (LAYOUT_READERS). No sequential head; the confidence head is not shipped.

All carry what the common serving mistakes get wrong: the block layout (`sample_from_anchor` and
`dspark_bonus_anchor` from draft.block_layout; anchor: slot k predicts the token after anchor + k), in-block
bidirectional attention (`is_causal: false`, `sliding_window_non_causal: true`), an explicit RoPE theta, the mask
token id.

Calibration (a draft with `calibration.json`, launch/calibrate_draft.py). vLLM's DSpark confidence head computes
σ(w·x + b) with one linear layer for every position and reads no calibration file, so the single temperature T of
the calibration is folded into that layer (w/T, b/T: exactly σ((w·x + b)/T)); config.json's
`dspark_confidence_calibration` says what was done. Beside it, `sts_calibration.json`: the per-position STS
temperatures in the form SGLang (`--speculative-dspark-confidence-sts-path`) and TensorRT-LLM
(`confidence_calibration_path`) read, relative to the exported (folded) head, so that an engine applying them
computes σ(raw logit / T_k) exactly. A calibration that a format cannot hold (no confidence head shipped), or an
older calibration.json without a single temperature, is said in one line (`calibration_note`).

What no engine can serve is refused with the reason and the preset that can (`NotServable`): MoE FFN and mHC
(only DeepSeek-V4's own drafter block exists in engines), a draft without per-head q/k norm or with a learned
mask vector, the final post-norm state (-1) as context, the RNN head in the deepspec schema (vanilla Markov
only), a confidence head without a Markov head in the deepspec schema (llama.cpp cannot load it), and the
non-DSpark baselines. Every mapping is a copy or a transpose (W2), or a concatenation (the RNN head's three
projections into `joint_proj`); nothing is approximated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draft_model.config import FINAL_HIDDEN, DraftConfig
from pipeline.export import read_export, write_export_dir
from serving.layer_ids import NotServable, check_target_layers

FORMATS = ("deepspec", "speculators", "dflash")
# the reader of each layout-sensitive format, and the layout it reads (docs/vllm-serving.md): vLLM's V1 DFlash
# proposer feeds the 1+γ query block [bonus, MASK x γ] and samples the mask slots, with no sample_from_anchor switch
# (V2's DFlash speculator refuses sample_from_anchor=True, vllm/v1/worker/gpu/spec_decode/dflash/speculator.py)
LAYOUT_READERS = {"dflash": ("bonus_anchor", "vllm/v1/spec_decode/dflash.py")}
DEEPSEEK_V4 = "deepseek-v4"  # arch dsv4's checkpoint layout (serving/deepseek_checkpoint.py)
STS_FILE = "sts_calibration.json"
SERVABLE_PRESETS = "dspark-markov (Markov head + confidence) or dflash (no sequential head)"


def check_servable(cfg: DraftConfig, fmt: str, drop_confidence: bool = False) -> None:
    """NotServable naming the first reason `cfg` cannot be exported in `fmt` (None when it can)."""
    if fmt not in FORMATS:
        raise NotServable(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    why = None
    if cfg.arch == "dsv4":  # servable, but as llama.cpp's DSV4 GGUF (serving/dsv4_gguf_export.py)
        raise NotServable(f"cannot export this draft as {fmt}: draft.arch='dsv4' is DeepSeek-V4's own drafter block, "
                          "which llama.cpp loads as a GGUF; write it with: python launch/export_draft.py RUN --format "
                          "gguf-dsv4 --target-gguf TARGET.gguf --out draft.gguf")
    if cfg.arch != "dspark":
        why = (f"draft.arch={cfg.arch!r} is a baseline with no DSpark engine format; engines serve arch 'dspark' "
               f"drafts")
    elif cfg.ffn != "dense" or cfg.residual != "plain":
        why = (f"draft.ffn={cfg.ffn!r}, draft.residual={cfg.residual!r}: engines implement a dense Qwen3 layer with a "
               "plain residual; MoE and mHC exist only inside DeepSeek-V4's own drafter block")
    elif not cfg.qk_norm:
        why = ("draft.qk_norm=false: every engine's DSpark layer applies a per-head q/k RMSNorm, which is nonlinear, "
               "so no export of a draft trained without it is faithful; retrain with draft.qk_norm=true")
    elif cfg.mask != "token":
        why = ("draft.mask=learned: the engines fill mask slots with the target embedding row of mask_token_id; "
               "retrain with draft.mask=token")
    elif FINAL_HIDDEN in cfg.target_layers:
        why = ("draft.target_layers holds -1, the target's final post-norm state, which engines do not hand to a "
               "draft (LLaMA/Qwen3 graphs expose decoder-layer inputs only); train on layers 0..L-1")
    elif fmt == "deepspec" and cfg.head == "rnn":
        why = ("draft.head=rnn: the deepspec schema's engines (vLLM, llama.cpp) run only the vanilla Markov head; "
               "use --format speculators, or draft.head=markov")
    elif fmt == "deepspec" and cfg.confidence and cfg.head == "none" and not drop_confidence:
        why = ("draft.confidence=true with draft.head=none: llama.cpp loads a confidence head only beside a Markov "
               "head; pass --drop-confidence to export without it, or use draft.head=markov")
    elif fmt in LAYOUT_READERS and cfg.block_layout != LAYOUT_READERS[fmt][0]:
        layout, reader = LAYOUT_READERS[fmt]
        why = (f"draft.block_layout={cfg.block_layout!r}, but {reader} reads every block in the {layout} layout "
               f"(the anchor slot predicts nothing, slot k the token at anchor + k), one slot off from this draft; "
               f"retrain with draft.block_layout={layout}")
    elif fmt == "dflash" and cfg.head != "none":
        why = (f"draft.head={cfg.head!r}: vLLM's DFlash model has no sequential head; use --format deepspec or "
               "speculators, or train the dflash preset (draft.head=none)")
    elif cfg.head == "rnn" and cfg.rnn_state_size != cfg.head_rank:
        why = (f"draft.rnn_state_size={cfg.rnn_state_size} != draft.head_rank={cfg.head_rank}: speculators' RNN head "
               "ties its state size to the rank")
    if why:
        raise NotServable(f"cannot export this draft as {fmt}: {why} (servable presets: {SERVABLE_PRESETS})")


def engine_tensors(state: dict[str, torch.Tensor], cfg: DraftConfig, drop_confidence: bool = False
                   ) -> dict[str, torch.Tensor]:
    """Our state dict under the engines' tensor names (both formats use the same names)."""
    out: dict[str, torch.Tensor] = {"fc.weight": state["backbone.ctx_proj.weight"],
                                    "hidden_norm.weight": state["backbone.ctx_norm.weight"],
                                    "norm.weight": state["backbone.final_norm.weight"]}
    ours_to_theirs = {"attn_norm.weight": "input_layernorm.weight",
                      "ffn_norm.weight": "post_attention_layernorm.weight",
                      **{f"attn.{p}.weight": f"self_attn.{p}.weight"
                         for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
                      **{f"ffn.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}
    for i in range(cfg.num_layers):
        for ours, theirs in ours_to_theirs.items():
            out[f"layers.{i}.{theirs}"] = state[f"backbone.layers.{i}.{ours}"]
    if cfg.head != "none":
        out["markov_head.markov_w1.weight"] = state["head.w1.weight"]
        out["markov_head.markov_w2.weight"] = state["head.w2_RV"].t()  # [V, r]: a Linear(r -> V) weight
    if cfg.head == "rnn":  # z = [s; W1[x]; h] in both; one joint projection split (gate, cand, out)
        for p in ("weight", "bias"):
            out[f"markov_head.joint_proj.{p}"] = torch.cat([state[f"head.w_{n}.{p}"] for n in ("gate", "cand", "out")])
    if cfg.confidence and not drop_confidence:
        out["confidence_head.proj.weight"] = state["conf_proj.weight"]
        out["confidence_head.proj.bias"] = state["conf_proj.bias"]
    return {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in out.items()}


def _qwen3_fields(cfg: DraftConfig, max_positions: int) -> dict[str, Any]:
    layer = {"model_type": "qwen3", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
             "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
             "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.resolved_head_dim,
             "intermediate_size": cfg.resolved_intermediate_size, "hidden_act": "silu",
             "rms_norm_eps": cfg.rms_norm_eps, "attention_bias": False, "max_position_embeddings": max_positions,
             # explicit: vLLM assumes 1e6 when it is missing
             "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
             "tie_word_embeddings": False}
    if cfg.sliding_window:
        # ours: every slot of a block sees the W context tokens before its anchor (and its block, bidirectional)
        layer.update(use_sliding_window=True, sliding_window=cfg.sliding_window,
                     layer_types=["sliding_attention"] * cfg.num_layers)
    return layer


def _dspark_fields(cfg: DraftConfig, drop_confidence: bool) -> dict[str, Any]:
    confidence = cfg.confidence and not drop_confidence
    return {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
            "sample_from_anchor": cfg.block_layout == "anchor",
            "markov_rank": cfg.head_rank if cfg.head != "none" else 0,
            "markov_head_type": "rnn" if cfg.head == "rnn" else "vanilla",
            "enable_confidence_head": confidence, "confidence_head_with_markov": confidence and cfg.head != "none"}


def engine_config(cfg: DraftConfig, fmt: str, target: dict[str, Any], drop_confidence: bool = False,
                  draft_vocab_size: int | None = None) -> dict[str, Any]:
    """config.json of the engine export. `target`: the target's config.json (num_hidden_layers,
    max_position_embeddings, architectures) plus "name_or_path". `draft_vocab_size`: a reduced draft vocabulary
    (serving/draft_vocab.py; deepspec only)."""
    max_positions = int(target.get("max_position_embeddings") or 8192)
    dspark = _dspark_fields(cfg, drop_confidence)
    layer_ids = [i - 1 for i in cfg.target_layers]  # decoder-layer outputs: hidden state i = output of i - 1
    if fmt == "dflash":  # z-lab's / vLLM's DFlash: block_size counts the bonus slot, num_speculative_tokens = γ
        return {"architectures": ["DFlashDraftModel"], **_qwen3_fields(cfg, max_positions),
                "block_size": cfg.block_size + 1, "num_target_layers": int(target["num_hidden_layers"]),
                "target_layer_ids": layer_ids, "torch_dtype": "float32",
                "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": cfg.mask_token_id,
                                  "causal": False}}
    if fmt == "deepspec":
        if draft_vocab_size:
            dspark["draft_vocab_size"] = draft_vocab_size
        return {"architectures": ["Qwen3DSparkModel"], **_qwen3_fields(cfg, max_positions), **dspark,
                "is_causal": False, "dspark_bonus_anchor": cfg.block_layout == "bonus_anchor",
                "target_layer_ids": layer_ids,
                "num_target_layers": int(target["num_hidden_layers"]), "torch_dtype": "float32",
                "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": cfg.mask_token_id,
                                  "block_size": cfg.block_size}}
    return {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": _qwen3_fields(cfg, max_positions), "draft_vocab_size": cfg.vocab_size,
            "aux_hidden_state_layer_ids": list(cfg.target_layers), "sliding_window_non_causal": True, **dspark,
            "speculators_config": {
                "algorithm": "dspark", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size}],
                "verifier": {"name_or_path": str(target.get("name_or_path")),
                             "architectures": list(target.get("architectures") or [])}}}


def sts_calibration(temperatures: list[float], meta: dict[str, Any]) -> dict[str, Any]:
    """The STS file SGLang and TensorRT-LLM read: per-position temperatures under both names they use."""
    def mean(x: Any) -> float | None:
        vals = [float(v) for v in (x if isinstance(x, list) else [x]) if v is not None]
        return sum(vals) / len(vals) if vals else None

    return {"temperatures": list(temperatures), "sts_temperatures": list(temperatures),
            "dataset": ",".join(map(str, meta.get("prompt_sets") or [])) or None,
            "num_samples": meta.get("fit_rounds"), "ece_before": mean(meta.get("held_out_ece_before")),
            "ece_after": mean(meta.get("held_out_ece_after"))}


def calibration_note(export_dir: str | Path, cfg: DraftConfig, fmt: str, drop_confidence: bool = False
                     ) -> tuple[Any, str | None]:
    """(the draft's Calibration or None, one line saying what an export in `fmt` does with it, or None when the
    draft is not calibrated)."""
    from serving.calibration import load_calibration

    path = Path(export_dir) / "calibration.json"
    if not path.is_file():
        return None, None
    cal = load_calibration(path)
    if fmt not in FORMATS:  # DeepSeek-V4's drafter formats (gguf-dsv4, deepseek-v4)
        return cal, (f"{fmt} export: {path} is not carried: this format's confidence head is written as trained "
                     f"(uncalibrated)")
    if not cfg.confidence or drop_confidence or fmt == "dflash":
        why = (f"the {fmt} format has no confidence head" if fmt == "dflash" else
               "--drop-confidence" if drop_confidence else "the draft has none")
        return cal, f"{fmt} export: {path} is not carried: the confidence head is not shipped ({why})"
    if cal.single_temperature is None:
        return cal, (f"{fmt} export: {path} has no single temperature (written before dspark-sts/2), so the "
                     f"confidence head is exported uncalibrated and vLLM, which applies no calibration file, "
                     f"schedules on raw confidences; rerun launch/calibrate_draft.py to fit one")
    return cal, (f"{fmt} export: calibration T = {cal.single_temperature:.4g} folded into confidence_head.proj "
                 f"(what vLLM computes); per-position STS in {STS_FILE}, relative to the folded head")


def write_engine_export(export_dir: str | Path, fmt: str, out_dir: str | Path, target: dict[str, Any],
                        drop_confidence: bool = False,
                        draft_vocab: tuple[torch.Tensor, torch.Tensor] | None = None, say=None) -> Path:
    """Write `export_dir` (our format) as `fmt` into `out_dir` (replaced atomically): config.json,
    model.safetensors and, when the export was calibrated, sts_calibration.json (module docstring, "Calibration";
    `say(line)` is given calibration_note's line). `draft_vocab`: (ids_N, the target's lm_head_VD) to write a
    reduced draft vocabulary (serving/draft_vocab.py), deepspec only."""
    from serving.draft_vocab import reduce_vocab

    cfg, state, _ = read_export(export_dir)
    check_servable(cfg, fmt, drop_confidence)
    check_target_layers(cfg, int(target["num_hidden_layers"]), int(target.get("hc_mult", 1)))
    drop_confidence = drop_confidence or fmt == "dflash"  # vLLM's DFlash model has no confidence head
    if cfg.mask_token_id < 0 or not cfg.vocab_size:
        raise NotServable(f"{export_dir}: the draft config was never resolved against a target (mask_token_id "
                          f"{cfg.mask_token_id}, vocab_size {cfg.vocab_size})")
    tensors = engine_tensors(state, cfg, drop_confidence)
    if draft_vocab is not None:
        if fmt != "deepspec":
            raise NotServable(f"cannot export a reduced draft vocabulary as {fmt}: it is written in the deepspec "
                              "schema only (draft_vocab_size + d2t, as llama.cpp's converter reads them)")
        ids_N, lm_head_VD = draft_vocab
        if lm_head_VD.shape != (cfg.vocab_size, cfg.hidden_size):
            raise NotServable(f"the target's LM head is {tuple(lm_head_VD.shape)}, the draft expects "
                              f"({cfg.vocab_size}, {cfg.hidden_size}): not this draft's target")
        tensors = reduce_vocab(tensors, ids_N, lm_head_VD)
    n_draft = None if draft_vocab is None else len(draft_vocab[0])
    config = engine_config(cfg, fmt, target, drop_confidence, n_draft)
    cal, note = calibration_note(export_dir, cfg, fmt, drop_confidence)
    files = {}
    if cal is not None and "confidence_head.proj.weight" in tensors:
        fold = cal.single_temperature or 1.0
        for p in ("weight", "bias"):
            tensors[f"confidence_head.proj.{p}"] = tensors[f"confidence_head.proj.{p}"] / fold
        config["dspark_confidence_calibration"] = {
            "folded_temperature": cal.single_temperature, "sts_file": STS_FILE,
            "note": "confidence_head.proj holds the trained weight and bias divided by folded_temperature (null: "
                    "not folded); the STS file's temperatures apply to that head"}
        files[STS_FILE] = json.dumps(sts_calibration((cal.temperatures / fold).tolist(), cal.meta), indent=2) + "\n"
    if note and say is not None:
        say(note)
    files["config.json"] = json.dumps(config, indent=2) + "\n"
    return write_export_dir(out_dir, tensors, files, metadata={"format": "pt"})


def target_facts(target_dir: str | Path, name_or_path: str | None = None) -> dict[str, Any]:
    """What the engine config needs from a target model directory's config.json."""
    p = Path(target_dir) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"target {target_dir} has no config.json (a model directory is needed to export)")
    tc = json.loads(p.read_text())
    tc = {**tc, **tc.get("text_config", {})}
    return {"num_hidden_layers": tc["num_hidden_layers"], "max_position_embeddings": tc.get("max_position_embeddings"),
            "architectures": tc.get("architectures") or [], "name_or_path": name_or_path or str(target_dir),
            "hc_mult": int(tc.get("hc_mult", 1) or 1)}


def export_servable(export_dir: str | Path, run_dir: str | Path, target_dir: str | Path, target_name: str,
                    log) -> dict[str, Path]:
    """The end of a run: `<run_dir>/export-<format>` for every format the draft can be served in; one log line per
    format saying where it went or why not (nothing raised: our own export is already written)."""
    written: dict[str, Path] = {}
    if json.loads((Path(export_dir) / "config.json").read_text()).get("draft", {}).get("arch") == "dsv4":
        from serving.deepseek_checkpoint import write_deepseek_checkpoint

        try:
            depth = target_facts(target_dir, target_name)["num_hidden_layers"]
            written[DEEPSEEK_V4] = write_deepseek_checkpoint(export_dir, Path(run_dir) / f"export-{DEEPSEEK_V4}",
                                                             depth)
            log.info("exported the draft as a DeepSeek-V4 checkpoint (mtp.* tensors, MXFP4 routed experts) to %s",
                     written[DEEPSEEK_V4])
        except (FileNotFoundError, KeyError, ValueError) as e:
            log.info("no %s export: %s", DEEPSEEK_V4, e)
        # llama.cpp's DSV4 GGUF needs the target's GGUF (its tokenizer), which a run does not have
        log.info("arch dsv4 is served as llama.cpp's DSV4 GGUF: python launch/export_draft.py %s --format gguf-dsv4 "
                 "--target-gguf TARGET.gguf --out %s", run_dir, Path(run_dir) / "draft-dsv4.gguf")
        return written
    try:
        facts = target_facts(target_dir, target_name)
    except (FileNotFoundError, KeyError, ValueError) as e:
        log.info("engine export skipped: %s (launch/export_draft.py can write it later)", e)
        return written
    refused: dict[str, list[str]] = {}  # why -> the formats refused for it: one line per reason, not per format
    for fmt in FORMATS:
        try:
            written[fmt] = write_engine_export(export_dir, fmt, Path(run_dir) / f"export-{fmt}", facts,
                                               say=log.info)
            log.info("exported the draft for serving engines (%s format) to %s", fmt, written[fmt])
        except NotServable as e:
            refused.setdefault(str(e).split(": ", 1)[-1], []).append(fmt)
    for why, fmts in refused.items():
        log.info("no %s export: %s", ", ".join(fmts), why)
    return written
