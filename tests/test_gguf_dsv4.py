"""The DeepSeek-V4 drafter GGUF (serving/gguf_dsv4.py): what llama.cpp b11434's DFLASH/DSV4 loader requires, read
back with gguf's reader, the refusals, and llama.cpp itself loading the file and drafting γ tokens a round as the
draft of SmolLM2-135M.

Required by llama.cpp (paths in its source tree):
- keys, generic: `{arch}.context_length`, `.embedding_length`, `.block_count` (src/llama-model.cpp:1323-1329),
  `.expert_count`, `.expert_used_count` (:1333-1335), `.attention.head_count`, `.attention.head_count_kv` (:1398,
  :1406), `.attention.key_length`/`.value_length` (:1442-1445; equal, src/models/deepseek4.cpp:899),
  `.rope.dimension_count` (:1450), `.rope.freq_base` (:1417); `.attention.layer_norm_rms_epsilon`,
  `.target_layers` (src/models/dflash.cpp:23, :37-39);
- keys, DSV4 path (dflash.cpp:53-81): `.hyper_connection.count` > 0 selects it; `.attention.q_lora_rank`,
  `.attention.sliding_window`, `.expert_feed_forward_length`, `.expert_shared_count`, `.expert_weights_scale`,
  `.expert_weights_norm`, `.expert_gating_func` (= 4, sqrt-softplus, else it throws), `.swiglu_clamp_exp`,
  `.attention.output_group_count`, `.attention.output_lora_rank`, `.hyper_connection.sinkhorn_iterations`,
  `.hyper_connection.epsilon`, `.attention.compress_ratios` (all 0, else it throws);
- keys, DSpark runtime: `dflash.block_size` (dflash.cpp:311-313; common/speculative.cpp:1040-1043),
  `tokenizer.ggml.mask_token_id` (speculative.cpp:1056), the target's tokenizer (speculative.cpp:106-150);
- tensors: dflash.cpp:113-219 (`dsv4_shapes`), in ggml order (`ne`, the array shape reversed).

The llama.cpp test needs the build (python bench/llamacpp.py build); without it that one test is skipped.
Run: python -m pytest tests/test_gguf_dsv4.py -q
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import gguf
import llamacpp
import numpy as np
import pytest

from serving.gguf_dsv4 import DSV4DraftConfig, TargetFacts, dsv4_shapes, from_deepseek_names, write_dsv4_gguf

T = gguf.GGUFValueType


def _cfg(D: int = 64, **kw) -> DSV4DraftConfig:
    base = dict(hidden_size=D, num_layers=2, num_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=24,
                o_groups=2, o_lora_rank=16, sliding_window=128, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, num_shared_experts=1, block_size=5, target_layers=(1, 3), mask_token_id=3)
    return DSV4DraftConfig(**{**base, **kw})


def _tiny_target(D: int = 64, V: int = 96) -> TargetFacts:
    tok = {"tokenizer.ggml.model": ("gpt2", T.STRING, None),
           "tokenizer.ggml.tokens": ([f"t{i}" for i in range(V)], T.ARRAY, T.STRING),
           "tokenizer.ggml.token_type": ([1] * V, T.ARRAY, T.INT32),
           "tokenizer.ggml.eos_token_id": (2, T.UINT32, None)}
    return TargetFacts(arch="llama", hidden_size=D, num_layers=4, vocab_size=V, tokenizer=tok)


def random_tensors(cfg: DSV4DraftConfig, V: int, rank: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in llama.cpp's layout: norms and hc scales 1; sinks, biases, hc bases 0; the rest N(0, .02²)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in dsv4_shapes(cfg, V, rank).items():
        if name in ("token_embd.weight", "output.weight"):
            continue  # the target's
        if name.endswith("norm.weight") or "scale" in name:
            out[name] = np.ones(shape, np.float32)
        elif "sinks" in name or name.endswith(".bias") or "base" in name:
            out[name] = np.zeros(shape, np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return out


def _read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    kv = {k: (f.contents(), [t for t in f.types]) for k, f in r.fields.items()}
    tensors = {t.name: ([int(x) for x in t.shape], t.tensor_type) for t in r.tensors}
    return kv, tensors


def test_written_gguf_has_every_key_and_shape_llama_cpp_requires(tmp_path):
    cfg, target = _cfg(), _tiny_target()
    tensors = random_tensors(cfg, target.vocab_size)
    write_dsv4_gguf(tmp_path / "d.gguf", tensors, cfg, target)
    kv, shapes = _read(tmp_path / "d.gguf")

    want = {  # key: (value, GGUF type) with the type llama.cpp's get_key insists on (llama-model-loader.cpp:166)
        "general.architecture": ("dflash", T.STRING),
        "dflash.context_length": (8192, T.UINT32), "dflash.embedding_length": (64, T.UINT32),
        "dflash.block_count": (2, T.UINT32), "dflash.attention.head_count": (4, T.UINT32),
        "dflash.attention.head_count_kv": (1, T.UINT32), "dflash.attention.key_length": (32, T.UINT32),
        "dflash.attention.value_length": (32, T.UINT32), "dflash.rope.dimension_count": (8, T.UINT32),
        "dflash.rope.freq_base": (10000.0, T.FLOAT32),
        "dflash.attention.layer_norm_rms_epsilon": (pytest.approx(1e-6), T.FLOAT32),
        "dflash.expert_count": (4, T.UINT32), "dflash.expert_used_count": (2, T.UINT32),
        "dflash.expert_feed_forward_length": (32, T.UINT32), "dflash.expert_shared_count": (1, T.UINT32),
        "dflash.expert_weights_scale": (1.0, T.FLOAT32), "dflash.expert_weights_norm": (True, T.BOOL),
        "dflash.expert_gating_func": (4, T.UINT32), "dflash.attention.q_lora_rank": (24, T.UINT32),
        "dflash.attention.sliding_window": (128, T.UINT32), "dflash.attention.output_group_count": (2, T.UINT32),
        "dflash.attention.output_lora_rank": (16, T.UINT32), "dflash.hyper_connection.count": (4, T.UINT32),
        "dflash.hyper_connection.sinkhorn_iterations": (20, T.UINT32),
        "dflash.hyper_connection.epsilon": (pytest.approx(1e-6), T.FLOAT32),
        "dflash.block_size": (5, T.UINT32), "dflash.sample_from_anchor": (True, T.BOOL),
        "dflash.has_confidence_head": (True, T.BOOL), "dflash.attention.causal": (False, T.BOOL),
        "tokenizer.ggml.mask_token_id": (3, T.UINT32), "tokenizer.ggml.model": ("gpt2", T.STRING),
        "tokenizer.ggml.eos_token_id": (2, T.UINT32),
    }
    for key, (value, vtype) in want.items():
        assert key in kv, key
        assert kv[key][0] == value and kv[key][1] == [vtype], (key, kv[key])
    arrays = {"dflash.swiglu_clamp_exp": ([0.0, 0.0], T.FLOAT32), "dflash.swiglu_clamp_shexp": ([0.0, 0.0], T.FLOAT32),
              "dflash.attention.compress_ratios": ([0, 0], T.UINT32), "dflash.target_layers": ([1, 3], T.INT32),
              "tokenizer.ggml.token_type": ([1] * 96, T.INT32)}
    for key, (value, sub) in arrays.items():
        assert list(kv[key][0]) == value and kv[key][1] == [T.ARRAY, sub], (key, kv[key])
    assert kv["tokenizer.ggml.tokens"][0] == [f"t{i}" for i in range(96)]

    D, H, E, Q, G, O, X, I, V, r = 64, 4, 32, 24, 2, 16, 4, 32, 96, 16
    ne = {  # llama.cpp's create_tensor shapes (ne), dflash.cpp:129-219
        "fc.weight": [2 * D, D], "enc.output_norm.weight": [D], "output_norm.weight": [D],
        "output_hc_fn.weight": [4 * D, 4], "output_hc_base.weight": [4], "output_hc_scale.weight": [1],
        "markov_w1.weight": [r, V], "markov_w2.weight": [r, V], "conf_proj.weight": [D + r, 1], "conf_proj.bias": [1],
    }
    for i in range(2):
        b = f"blk.{i}."
        ne.update({b + "attn_norm.weight": [D], b + "attn_sinks.weight": [H], b + "attn_q_a.weight": [D, Q],
                   b + "attn_q_a_norm.weight": [Q], b + "attn_q_b.weight": [Q, H * E], b + "attn_kv.weight": [D, E],
                   b + "attn_kv_a_norm.weight": [E], b + "attn_output_a.weight": [H * E // G, O, G],
                   b + "attn_output_b.weight": [G * O, D],
                   b + "hc_attn_fn.weight": [4 * D, 24], b + "hc_attn_base.weight": [24],
                   b + "hc_attn_scale.weight": [3], b + "hc_ffn_fn.weight": [4 * D, 24],
                   b + "hc_ffn_base.weight": [24], b + "hc_ffn_scale.weight": [3],
                   b + "ffn_gate_inp.weight": [D, X], b + "exp_probs_b.bias": [X], b + "ffn_norm.weight": [D],
                   b + "ffn_gate_exps.weight": [D, I, X], b + "ffn_down_exps.weight": [I, D, X],
                   b + "ffn_up_exps.weight": [D, I, X], b + "ffn_gate_shexp.weight": [D, I],
                   b + "ffn_down_shexp.weight": [I, D], b + "ffn_up_shexp.weight": [D, I]})
    assert {k: v[0] for k, v in shapes.items()} == ne  # exactly these: any other tensor fails llama.cpp's count
    assert all(t == gguf.GGMLQuantizationType.F32 for _, t in shapes.values())
    got = gguf.GGUFReader(str(tmp_path / "d.gguf")).get_tensor(0)
    assert np.array_equal(np.asarray(got.data).reshape(tensors[got.name].shape), tensors[got.name])

    # f16: matrices halve; norms, biases, sinks, hyper-connection parameters and wo_a stay f32
    write_dsv4_gguf(tmp_path / "h.gguf", tensors, cfg, target, dtype="f16")
    _, half = _read(tmp_path / "h.gguf")
    F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    assert half["blk.0.ffn_up_exps.weight"][1] == F16 and half["fc.weight"][1] == F16
    assert half["blk.0.hc_attn_fn.weight"][1] == F32 and half["blk.1.attn_kv_a_norm.weight"][1] == F32
    assert half["blk.0.attn_output_a.weight"][1] == F32


def test_deepseek_2d_wo_a_is_accepted_and_conf_bias_optional(tmp_path):
    cfg, target = _cfg(), _tiny_target()
    t = random_tensors(cfg, target.vocab_size)
    t["blk.0.attn_output_a.weight"] = t["blk.0.attn_output_a.weight"].reshape(2 * 16, -1)  # DeepSeek's [G·O, H·E/G]
    del t["conf_proj.bias"]
    write_dsv4_gguf(tmp_path / "d.gguf", t, cfg, target)
    kv, shapes = _read(tmp_path / "d.gguf")
    assert shapes["blk.0.attn_output_a.weight"][0] == [64, 16, 2] and "conf_proj.bias" not in shapes
    t = random_tensors(cfg, target.vocab_size)
    for k in ("conf_proj.weight", "conf_proj.bias"):
        del t[k]
    write_dsv4_gguf(tmp_path / "n.gguf", t, cfg, target)
    assert _read(tmp_path / "n.gguf")[0]["dflash.has_confidence_head"][0] is False


def test_mxfp4_experts_are_quantized_and_nothing_else(tmp_path):
    """mxfp4_experts: the routed experts as MXFP4 blocks (32 values, one shared exponent) within a 4-bit step of the
    input; every other tensor unchanged (F32)."""
    cfg, target = _cfg(), _tiny_target()
    t = random_tensors(cfg, target.vocab_size)
    write_dsv4_gguf(tmp_path / "q.gguf", t, cfg, target, mxfp4_experts=True)
    r = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    for x in r.tensors:
        if x.name.endswith("_exps.weight"):
            assert x.tensor_type == gguf.GGMLQuantizationType.MXFP4, x.name
            back = gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(t[x.name].shape)
            # e2m1 has 1 bit of mantissa: an error up to a quarter of the block's largest magnitude
            assert np.abs(back - t[x.name]).max() <= 0.25 * np.abs(t[x.name]).max(), x.name
        else:
            assert x.tensor_type == gguf.GGMLQuantizationType.F32, x.name


def _as_deepseek(t: dict[str, np.ndarray], stages: int) -> dict[str, np.ndarray]:
    """The same draft as DeepSeek-V4 checkpoint tensors, named from conversion/deepseek.py's tables (read by hand):
    root tensors in the last stage, routed experts one tensor per expert, wo_a in DeepSeek's 2-D [G·O, H·E/G]."""
    root = {"fc.weight": "main_proj.weight", "enc.output_norm.weight": "main_norm.weight",
            "output_norm.weight": "norm.weight", "output_hc_fn.weight": "hc_head_fn",
            "output_hc_base.weight": "hc_head_base", "output_hc_scale.weight": "hc_head_scale",
            "markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
            "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias"}
    layer = {"attn_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
             "attn_sinks.weight": "attn.attn_sink", "attn_q_a.weight": "attn.wq_a.weight",
             "attn_q_a_norm.weight": "attn.q_norm.weight", "attn_q_b.weight": "attn.wq_b.weight",
             "attn_kv.weight": "attn.wkv.weight", "attn_kv_a_norm.weight": "attn.kv_norm.weight",
             "attn_output_b.weight": "attn.wo_b.weight", "ffn_gate_inp.weight": "ffn.gate.weight",
             "exp_probs_b.bias": "ffn.gate.bias", "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
             "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
             "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight"}
    out = {}
    for name, a in t.items():
        if name in root:
            out[f"mtp.{stages - 1}.{root[name]}"] = a
            continue
        _, i, rest = name.split(".", 2)
        if rest in layer:
            out[f"mtp.{i}.{layer[rest]}"] = a
        elif rest.startswith("hc_"):
            out[f"mtp.{i}.{rest.removesuffix('.weight')}"] = a
        elif rest == "attn_output_a.weight":
            out[f"mtp.{i}.attn.wo_a.weight"] = a.reshape(-1, a.shape[-1])
        else:
            w = {"ffn_gate_exps.weight": "w1", "ffn_down_exps.weight": "w2", "ffn_up_exps.weight": "w3"}[rest]
            for e in range(a.shape[0]):
                out[f"mtp.{i}.ffn.experts.{e}.{w}.weight"] = a[e]
    return out


def test_deepseek_checkpoint_names_map_onto_llama_cpp_names(tmp_path):
    cfg, target = _cfg(), _tiny_target()
    t = random_tensors(cfg, target.vocab_size)
    ds = _as_deepseek(t, cfg.num_layers)
    assert len(ds) == len(t) - 3 * cfg.num_layers + 3 * cfg.num_layers * cfg.num_experts
    back = from_deepseek_names(ds)
    assert set(back) == set(t)
    for name, a in t.items():
        assert np.array_equal(back[name].reshape(a.shape), a), name
    write_dsv4_gguf(tmp_path / "d.gguf", back, cfg, target)  # wo_a goes in DeepSeek's 2-D form
    with pytest.raises(ValueError, match=r"'mtp.0.ffn.experts.1.w1.scale' is a quantization scale"):
        from_deepseek_names({**ds, "mtp.0.ffn.experts.1.w1.scale": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match=r"expert ids \[0, 1, 3\]"):
        from_deepseek_names({k: v for k, v in ds.items() if ".experts.2." not in k})
    with pytest.raises(ValueError, match="'mtp.0.attn.compressor.wkv.weight' has no llama.cpp DSV4 counterpart"):
        from_deepseek_names({**ds, "mtp.0.attn.compressor.wkv.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="'layers.0.attn_norm.weight': expected mtp.<stage>.<name>"):
        from_deepseek_names({"layers.0.attn_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="differs from another stage's copy of fc.weight"):
        from_deepseek_names({**ds, "mtp.0.main_proj.weight": ds["mtp.1.main_proj.weight"] + 1})


@pytest.mark.parametrize("change, match", [
    (lambda t, c: t.pop("blk.1.attn_kv.weight"), "missing tensor 'blk.1.attn_kv.weight'"),
    (lambda t, c: t.__setitem__("blk.0.attn_q_b.weight", np.zeros((128, 23), np.float32)),
     r"'blk.0.attn_q_b.weight' has shape \(128, 23\), expected \(128, 24\)"),
    (lambda t, c: t.__setitem__("blk.0.attn_q.weight", np.zeros((4, 4), np.float32)), "unknown tensor 'blk.0.attn_q"),
    (lambda t, c: t.__setitem__("fc.weight", np.full((64, 128), np.nan, np.float32)), "fc.weight holds non-finite"),
    (lambda t, c: t.pop("markov_w1.weight"), "without markov_w1.weight"),
    (lambda t, c: replace(c, hidden_size=576), "hidden_size 576 != the target's 64"),
    (lambda t, c: replace(c, target_layers=(1, 4)), "target layer 4 is not exposed by a 'llama' target of 4"),
    (lambda t, c: replace(c, target_layers=()), "target_layers is empty"),
    (lambda t, c: replace(c, hc_mult=2), "hc_mult 2"),
    (lambda t, c: replace(c, o_groups=3), "num_heads 4 is not a multiple of o_groups 3"),
    (lambda t, c: replace(c, qk_rope_head_dim=33), "qk_rope_head_dim 33"),
    (lambda t, c: replace(c, num_experts_per_tok=5), "num_experts_per_tok 5"),
    (lambda t, c: replace(c, mask_token_id=96), "mask_token_id 96 is outside"),
])
def test_bad_inputs_are_one_line_value_errors(tmp_path, change, match):
    cfg, target = _cfg(), _tiny_target()
    t = random_tensors(cfg, target.vocab_size)
    new = change(t, cfg)
    cfg = new if isinstance(new, DSV4DraftConfig) else cfg
    with pytest.raises(ValueError, match=match) as e:
        write_dsv4_gguf(tmp_path / "d.gguf", t, cfg, target)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "d.gguf").exists()


@pytest.fixture(scope="module")
def smollm2_gguf() -> tuple[Path, TargetFacts]:
    """The SmolLM2-135M f32 target GGUF (converted once by llama.cpp's converter) and its facts."""
    if not llamacpp.binary("llama-speculative-simple").is_file():
        pytest.skip("llama.cpp not built (python bench/llamacpp.py build)")
    target_gguf = llamacpp.target_gguf("smollm2")
    return target_gguf, TargetFacts.from_gguf(target_gguf)


def _smollm2_cfg() -> DSV4DraftConfig:
    """A DSV4 draft of SmolLM2-135M's width (D 576) reading three of its 30 layers."""
    return _cfg(576, num_heads=4, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_lora_rank=32,
                target_layers=(2, 15, 29))


@pytest.mark.parametrize("dtype", ["f32", pytest.param("f16", marks=pytest.mark.slow)])  # f16: 20-130 s more
def test_llama_cpp_loads_the_dsv4_draft_and_drafts_gamma_tokens(tmp_path, smollm2_gguf, dtype):
    """A random-weight DSV4 draft of SmolLM2's width (D 576) in llama-speculative-simple against the SmolLM2-135M
    f32 target: it must select the DSV4 graph and draft-dspark, and draft γ tokens in every round (acceptance is
    about 0 with random weights)."""
    from serve_llamacpp import parse_rounds, speculative_simple

    target_gguf, target = smollm2_gguf
    assert (target.arch, target.hidden_size, target.num_layers, target.vocab_size) == ("llama", 576, 30, 49152)
    cfg = _smollm2_cfg()
    write_dsv4_gguf(tmp_path / "draft.gguf", random_tensors(cfg, target.vocab_size), cfg, target, dtype=dtype)
    res = speculative_simple(target_gguf, tmp_path / "draft.gguf", "def fibonacci(n):", 5, 0.0, 16, ctx=256)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert "DFlash extract_layers = [2, 15, 29]" in log
    assert "DFlash with DSpark markov head (rank = 16)" in log
    assert "adding speculative implementation 'draft-dspark'" in log
    assert "block_size=5, mask_token_id=3, n_extract=3, sample_from_anchor=true" in log
    assert "resolving fused DeepSeek V4 HC support" in log  # the hyper-connection graph (llama-context.cpp:578)
    # "accepted k/n draft tokens": n is the size of the draft the target verified, γ unless the tool truncates it to
    # the -n budget left, n_predict - done - 1 (examples/speculative-simple/speculative-simple.cpp:181-185, 297)
    rounds = [(int(k), int(n)) for k, n in re.findall(r"accepted (\d+)/(\d+) draft tokens", log)]
    done, checked = 0, 0
    for k, n in rounds:
        budget = 16 - done - 1
        if budget > 0:
            assert n == min(5, budget), (rounds, done)
            checked += n == 5
        done += k + 1
    assert checked >= 8, rounds
    assert re.search(r"called impl draft-dspark, hist size = \d+, call_count = \d+, gen = 5", log)
    blocks = [block for _, block in parse_rounds(log)]  # every slot's argmax, before the truncation
    assert all(len(b) == 5 and all(0 <= t < target.vocab_size for t in b) for b in blocks), blocks


@pytest.mark.parametrize("p_min, drafted", [(0.4, 5), (0.6, 0)])
def test_llama_cpp_cuts_the_block_at_the_confidence_threshold(tmp_path, smollm2_gguf, p_min, drafted):
    """--spec-draft-p-min, as bench/serve_llamacpp.draft_flags passes it (bench/learning_curve.py serves at the
    fastest threshold): llama.cpp cuts each DSpark block at its first slot whose confidence is below p_min. With
    the confidence head's weight 0 and bias 0 every slot's confidence is sigmoid(0) = 0.5: above 0.4 the target
    verifies γ tokens a round, below 0.6 none."""
    from serve_llamacpp import speculative_simple

    target_gguf, target = smollm2_gguf
    cfg = _smollm2_cfg()
    tensors = random_tensors(cfg, target.vocab_size)
    tensors["conf_proj.weight"][:] = 0
    tensors["conf_proj.bias"][:] = 0
    write_dsv4_gguf(tmp_path / "draft.gguf", tensors, cfg, target)
    res = speculative_simple(target_gguf, tmp_path / "draft.gguf", "def fibonacci(n):", 5, 0.0, 16, ctx=256,
                             p_min=p_min)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-3000:]
    assert f"p_min={p_min:.2f}" in log
    # "accepted k/n draft tokens": n, the tokens verified, is γ at 0.4 and 0 at 0.6 (while the -n budget lasts)
    rounds = [(int(k), int(n)) for k, n in re.findall(r"accepted (\d+)/(\d+) draft tokens", log)]
    assert len(rounds) >= 3, log[-3000:]
    done = 0
    for k, n in rounds:
        if 16 - done - 1 > 0:
            assert n == min(drafted, 16 - done - 1), (rounds, done)
        done += k + 1
    assert int(re.search(r"n_drafted = (\d+)", log).group(1)) == sum(n for _, n in rounds)
