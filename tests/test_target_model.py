"""Target model: loading, the SmolLM2 GGUF -> safetensors cache, tiny MoE targets and feature capture.

Run: python -m pytest tests/test_target_model.py -q          (add -m slow for the direct GGUF load test)
The first run on a machine converts SmolLM2 once (~15-40 s) into $DSPARK_CACHE or ~/.cache/dspark.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.data.chat import render_chat
from workers.frozen_target import model as tm

PROMPT = [{"role": "user", "content": "Write a Python function that reverses a string."},
          {"role": "assistant", "content": "def reverse(s):\n    return s[::-1]"}]


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = tm.load_target(tm.smollm2_path())
    return model, tokenizer


@pytest.fixture(scope="module")
def prompt_ids(smol):
    ids, _ = render_chat(smol[1], PROMPT, sample_name="prompt")
    return torch.as_tensor(ids)[None]


def _lm_head_output_shapes(model):
    shapes = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    return shapes, handle


def test_smollm2_final_is_exact_lm_head_input(smol, prompt_ids):
    model, _ = smol
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    V, D, L = tm.target_dims(model)
    assert (V, D, L) == (49152, 576, 30)
    shapes, handle = _lm_head_output_shapes(model)
    try:
        ctx, final = tm.capture_features(model, prompt_ids, torch.ones_like(prompt_ids), [3, 15, -1])
    finally:
        handle.remove()
    B, T = prompt_ids.shape
    assert shapes == [(B, 1, V)], "capture must not make the LM head compute logits for every position"
    assert ctx.shape == (B, T, 3 * D) and final.shape == (B, T, D)
    with torch.no_grad():
        ref = model(prompt_ids, output_hidden_states=True)
    torch.testing.assert_close(model.get_output_embeddings()(final), ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(ctx[..., :D], ref.hidden_states[3], atol=0, rtol=0)
    torch.testing.assert_close(ctx[..., D:2 * D], ref.hidden_states[15], atol=0, rtol=0)
    torch.testing.assert_close(ctx[..., 2 * D:], final, atol=0, rtol=0)
    # The real weights guess half of this chat's next tokens (measured 0.50; random weights ~0): a check that the
    # dequantized GGUF weights landed in the right places.
    assert (ref.logits[0, :-1].argmax(-1) == prompt_ids[0, 1:]).float().mean() > 0.4


def test_smollm2_cache_is_reused_and_unquantized(smol, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("second smollm2_path call must hit the cache, not convert again")

    monkeypatch.setattr(tm, "_load_gguf", no_conversion)
    path = tm.smollm2_path()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    embed, head = tm.embedding_weights(smol[0])
    assert embed is head and embed.shape == (49152, 576)


def test_tokenizer_without_cache_comes_from_gguf(tmp_path, smol):
    tok = tm.smollm2_tokenizer(tmp_path)  # empty cache: read from the GGUF, no conversion
    assert list(tmp_path.iterdir()) == []
    text = "def f(x):\n    return x ** 2  # ünïcode"
    assert tok(text)["input_ids"] == smol[1](text)["input_ids"] and tok.chat_template == smol[1].chat_template


def test_conversion_crash_leaves_no_cache(tmp_path, monkeypatch):
    tiny = tm.tiny_moe_target("qwen3_moe", seed=0, tokenizer=tm.smollm2_tokenizer())
    monkeypatch.setattr(tm, "_load_gguf", lambda path, **kw: tiny)

    def crash(model, tokenizer, out_dir):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("simulated crash mid-conversion")

    with monkeypatch.context() as m:
        m.setattr(tm, "_save_converted", crash)
        with pytest.raises(RuntimeError, match="simulated"):
            tm.smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == [], "a crashed conversion must leave nothing behind"
    out = tm.smollm2_path(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
    model, _ = tm.load_target(out)
    torch.testing.assert_close(model.get_input_embeddings().weight, tiny[0].get_input_embeddings().weight)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_tiny_moe_capture_and_round_trip(kind, smol, tmp_path):
    tokenizer = smol[1]
    model, tok = tm.tiny_moe_target(kind, seed=1, tokenizer=tokenizer)
    assert tm.target_dims(model) == (49152, 64, 3)
    embed, head = tm.embedding_weights(model)
    assert embed is not head and not torch.equal(embed, head)
    ids = torch.as_tensor(tokenizer("import os\nprint(os.getcwd())\n")["input_ids"])[None]
    layers = [0, 2, -1]
    ctx, final = tm.capture_features(model, ids, torch.ones_like(ids), layers)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(model.get_output_embeddings()(final), ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(ctx[..., :64], ref.hidden_states[0], atol=0, rtol=0)
    torch.testing.assert_close(ctx[..., 64:128], ref.hidden_states[2], atol=0, rtol=0)
    assert ctx[..., 64:128].std() > 1e-3  # random init (std 0.02): real, non-constant features

    reloaded, tok2 = tm.load_target(tm.save_target(model, tok, tmp_path / kind))
    assert type(reloaded) is type(model) and len(tok2) == len(tok)
    ctx2, final2 = tm.capture_features(reloaded, ids, torch.ones_like(ids), layers)
    assert torch.equal(ctx, ctx2) and torch.equal(final, final2)
    # Same seed, same weights; another seed, other weights.
    again, _ = tm.tiny_moe_target(kind, seed=1, tokenizer=tokenizer)
    other, _ = tm.tiny_moe_target(kind, seed=2, tokenizer=tokenizer)
    assert torch.equal(again.get_input_embeddings().weight, embed)
    assert not torch.equal(other.get_input_embeddings().weight, embed)


def test_bad_paths_and_layers(tmp_path, smol):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tm.load_target(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither a local path"):
        tm.load_target("no-such-model-name-xyz")
    with pytest.raises(ValueError, match="no config.json"):
        tm.load_target(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        tm.load_target(tmp_path / "weights.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        tm.load_target(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="out of range"):
        tm.capture_features(smol[0], ids, torch.ones_like(ids), [31])
    with pytest.raises(ValueError, match="tiny_moe_target kind"):
        tm.tiny_moe_target("llama", tokenizer=smol[1])


@pytest.mark.slow
def test_direct_gguf_load_matches_converted_cache(smol, prompt_ids):
    model, tokenizer = tm.load_target(tm.smollm2_gguf())
    assert tokenizer(PROMPT[0]["content"])["input_ids"] == smol[1](PROMPT[0]["content"])["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(prompt_ids).logits, smol[0](prompt_ids).logits, atol=1e-5, rtol=0)


def test_stop_token_ids_are_the_generation_configs_and_the_tokenizers_together():
    """One rule for regeneration and evaluation: a chat model's end-of-turn (generation config) and its tokenizer's
    eos both end a reply."""
    from types import SimpleNamespace as NS

    from workers.frozen_target.model import stop_token_ids

    assert stop_token_ids(NS(generation_config=NS(eos_token_id=[2, 5])), NS(eos_token_id=0)) == [0, 2, 5]
    assert stop_token_ids(NS(generation_config=NS(eos_token_id=2)), NS(eos_token_id=2)) == [2]
    assert stop_token_ids(NS(generation_config=NS(eos_token_id=None)), NS(eos_token_id=7)) == [7]
    assert stop_token_ids(NS(), None) == []  # a bare module and no tokenizer: nothing stops a reply
