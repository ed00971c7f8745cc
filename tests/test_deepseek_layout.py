"""DeepSeek-V4 as DeepSeek publishes it (the checkpoint layout vLLM loads) on our side: transformers 5.24 reads that
layout into the same model, our capture gives the same features from it (stream means at the context layers, the
exact LM-head input as the final state), and the trainers' embedding and LM head are read from it by name
(`vllm_worker.checkpoint_embeddings`). So one checkpoint directory serves both target backends.

Run: python -m pytest -q tests/test_deepseek_layout.py
"""

from __future__ import annotations

import json

import pytest
import torch
from deepseek_layout import save_deepseek_layout, tiny_v4

from workers.frozen_target import model as tm
from workers.frozen_target.vllm_engine.engine import aux_layer_ids, first_aux_id
from workers.frozen_target.vllm_worker import checkpoint_embeddings


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    tok = tm.smollm2_tokenizer()
    model = tiny_v4(tok, seed=1)
    return model, save_deepseek_layout(model, tok, tmp_path_factory.mktemp("v4") / "target")


def test_the_published_layout_is_what_vllm_reads(v4):
    from safetensors import safe_open

    _, path = v4
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 128, 4] and cfg["num_hash_layers"] == 1
    assert cfg["topk_method"] == "noaux_tc" and cfg["qk_rope_head_dim"] == 64 and "layer_types" not in cfg
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
            "layers.0.attn.kv_norm.weight", "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias",
            "layers.1.attn.indexer.wq_b.weight"} <= keys
    assert not any(k.startswith("model.") for k in keys)


def test_transformers_reads_it_into_the_same_model_and_captures_the_same_features(v4):
    model, path = v4
    loaded, _ = tm.load_target(path, torch.float32)
    g = torch.Generator().manual_seed(0)
    ids_BL = torch.randint(1, 1000, (2, 40), generator=g)
    mask_BL = torch.ones_like(ids_BL)
    layers = [1, 3, 4, -1]  # layer outputs (stream means), L and the LM-head input
    with torch.no_grad():
        want = tm.capture_features(model, ids_BL, mask_BL, layers)
        got = tm.capture_features(loaded, ids_BL, mask_BL, layers)
        states = model(input_ids=ids_BL, attention_mask=mask_BL, output_hidden_states=True).hidden_states
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    D = model.config.hidden_size
    assert torch.equal(got[0][..., :D], states[1].mean(dim=-2))  # the stream mean vLLM's V4 hands its DSpark drafter
    # the embeddings the trainers apply, read by name from the published layout
    embed_VD, head_VD = checkpoint_embeddings(path, "float32")
    assert torch.equal(embed_VD, model.get_input_embeddings().weight)
    assert torch.equal(head_VD, model.get_output_embeddings().weight)


def test_on_the_vllm_backend_a_v4_target_has_no_embeddings_layer(v4):
    _, path = v4
    cfg = json.loads((path / "config.json").read_text())
    assert first_aux_id(cfg) == 1
    assert aux_layer_ids([1, 3, 4, -1], 4, first_aux_id(cfg)) == [1, 3, -1]
    with pytest.raises(ValueError, match="does not capture the embeddings"):
        aux_layer_ids([0, -1], 4, first_aux_id(cfg))
