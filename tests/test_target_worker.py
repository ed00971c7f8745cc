"""Target worker: micro-batching, padding-free dense features, wire dtype, and one real local Ray actor.

Run: python -m pytest tests/test_target_worker.py -q     (-m slow adds the real Ray actor against the plain worker)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.contracts import TokenizedSample
from workers.frozen_target import model as tm
from workers.frozen_target.worker import TargetWorker, plan_micro_batches, start_target_actor

LAYERS = [1, 3, -1]


@pytest.fixture(scope="module")
def tokenizer():
    return tm.smollm2_tokenizer()


@pytest.fixture(scope="module")
def tiny_dirs(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for kind in ("qwen3_moe", "deepseek_v3"):
        model, tok = tm.tiny_moe_target(kind, seed=5, tokenizer=tokenizer)
        out[kind] = tm.save_target(model, tok, root / kind)
    model, tok = tm.tiny_moe_target("qwen3_moe", seed=6, tokenizer=tokenizer, tie_word_embeddings=True)
    out["tied"] = tm.save_target(model, tok, root / "tied")
    return out


def _samples(tokenizer, lengths: list[int], first_id: int = 100) -> list[TokenizedSample]:
    text = open(np.__file__).read() * 4  # real text to cut sequences from
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out, pos = [], 0
    for k, n in enumerate(lengths):
        mask = np.arange(n) % 3 != 0
        out.append(TokenizedSample(first_id + k, np.asarray(ids[pos:pos + n], dtype=np.int32), mask))
        pos += n
    return out


def test_plan_micro_batches_bounds_padded_tokens():
    lengths = [5, 40, 7, 12, 90, 3, 33, 20]
    groups = plan_micro_batches(lengths, max_tokens_per_forward=48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 48 or len(g) == 1
    assert [4] in groups  # longer than the bound: alone
    assert len(groups) == 5  # [3,5,7,12] [20] [33] [40] [90]: sorted by length, padding stays small


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_encode_equals_unpadded_per_sequence_forward(kind, tiny_dirs, tokenizer):
    samples = _samples(tokenizer, [23, 5, 61, 40, 2, 17])
    worker = TargetWorker(tiny_dirs[kind], LAYERS, wire_dtype="float32", max_tokens_per_forward=128)
    fb = worker.encode(7, samples)
    assert fb.batch_index == 7 and fb.sample_ids == (100, 101, 102, 103, 104, 105)
    assert fb.seq_start_S1.tolist() == [0, 23, 28, 89, 129, 131, 148]
    assert fb.ctx_feats_TF.shape == (148, 3 * 64) and fb.final_hidden_TD.shape == (148, 64)
    assert fb.input_ids_T.dtype == torch.int64 and fb.loss_mask_T.dtype == torch.bool
    for s, a, b in zip(samples, fb.seq_start_S1[:-1], fb.seq_start_S1[1:]):
        ids = torch.as_tensor(s.input_ids, dtype=torch.long)[None]
        ctx, fin = tm.capture_features(worker.model, ids, torch.ones_like(ids), LAYERS)
        assert torch.equal(fb.input_ids_T[a:b], ids[0]) and np.array_equal(fb.loss_mask_T[a:b].numpy(), s.loss_mask)
        # Padding must not leak into real positions (batched vs alone differs only by float reduction order).
        torch.testing.assert_close(fb.ctx_feats_TF[a:b], ctx[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fb.final_hidden_TD[a:b], fin[0], atol=1e-5, rtol=1e-5)


def test_wire_dtype_bf16_and_info(tiny_dirs, tokenizer):
    samples = _samples(tokenizer, [30, 9, 14])
    fp32 = TargetWorker(tiny_dirs["qwen3_moe"], LAYERS, wire_dtype="float32", max_tokens_per_forward=64)
    bf16 = TargetWorker(tiny_dirs["qwen3_moe"], LAYERS, max_tokens_per_forward=64)
    ref, wire = fp32.encode(0, samples), bf16.encode(0, samples)
    assert wire.ctx_feats_TF.dtype == torch.bfloat16 and wire.final_hidden_TD.dtype == torch.bfloat16
    assert torch.equal(wire.ctx_feats_TF, ref.ctx_feats_TF.to(torch.bfloat16))
    assert wire.nbytes() < ref.nbytes()
    assert bf16.info() == (49152, 64, 3)
    embed, head = bf16.embedding_weights()
    assert embed.device.type == "cpu" and embed is not head and embed.shape == head.shape == (49152, 64)
    with pytest.raises(ValueError, match="out of range"):
        TargetWorker(tiny_dirs["qwen3_moe"], [4], max_tokens_per_forward=64)
    with pytest.raises(ValueError, match="no samples"):
        bf16.encode(1, [])
    with pytest.raises(ValueError, match="unknown dtype"):
        TargetWorker(tiny_dirs["qwen3_moe"], LAYERS, wire_dtype="float13")


@pytest.mark.slow  # ~15 s with its Ray cluster; the sharded group test and the fault run use the actor by default
def test_ray_actor_matches_plain_worker(local_ray, tiny_dirs, tokenizer):
    samples = _samples(tokenizer, [12, 25, 8])
    actor = start_target_actor(str(tiny_dirs["tied"]), LAYERS, num_cpus=1, max_tokens_per_forward=64)
    remote_fb = local_ray.get(actor.encode.remote(3, samples))
    local_fb = TargetWorker(tiny_dirs["tied"], LAYERS, max_tokens_per_forward=64).encode(3, samples)
    assert remote_fb.sample_ids == local_fb.sample_ids
    assert torch.equal(remote_fb.ctx_feats_TF, local_fb.ctx_feats_TF)
    assert torch.equal(remote_fb.final_hidden_TD, local_fb.final_hidden_TD)
    assert local_ray.get(actor.info.remote()) == (49152, 64, 3)
    embed, head = local_ray.get(actor.embedding_weights.remote())
    assert embed is head, "a tied target's embedding must arrive as one tensor"
    local_ray.kill(actor)
