"""The target's side of GPU correctness, on the CPU: a DeepSeek-V4 target's multi-layer context (its [B, L, 4, D]
layer states reduced to [B, L, D] by the serving engines' stream mean), capture hooks that keep only the layers a
run sends (equal to output_hidden_states, fp32, on tiny Qwen3-MoE / DeepSeek-V3 / DeepSeek-V4 and SmolLM2), an
out-of-memory forward that is fatal and one line instead of a lost member, group members that see the node's GPUs
and bind their bundle's, and ranks 1..N-1 of a target group that copy nothing to the host.

Run: python -m pytest -q tests/test_target_capture.py     (-m slow adds SmolLM2 and the 2-rank gloo group)
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from dist_helpers import run_ranks

from pipeline.contracts import TokenizedSample
from workers.frozen_target import group as group_mod
from workers.frozen_target import model as tm
from workers.frozen_target import worker as worker_mod
from workers.oom import OutOfMemory

FINAL = -1


@pytest.fixture(scope="module")
def tok():
    return tm.smollm2_tokenizer()


def _ids(n: int = 2, length: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids_BL = torch.randint(1, 1000, (n, length), generator=g)
    mask_BL = torch.ones_like(ids_BL)
    mask_BL[1, length - 7:] = 0  # a right-padded row
    return ids_BL, mask_BL


def _all_states(model, ids_BL, mask_BL):
    with torch.no_grad():
        return model(input_ids=ids_BL, attention_mask=mask_BL, output_hidden_states=True, use_cache=False).hidden_states


def test_v4_multi_layer_capture_is_the_stream_mean(tok):
    model, _ = tm.tiny_moe_target("deepseek_v4", seed=3, tokenizer=tok)
    ids_BL, mask_BL = _ids()
    states = _all_states(model, ids_BL, mask_BL)
    num_layers = model.config.num_hidden_layers
    assert states[2].shape == (2, 24, 4, 64) and states[num_layers].shape == (2, 24, 64)  # what V4 records
    ctx_BLF, final_BLD = tm.capture_features(model, ids_BL, mask_BL, [0, 2, FINAL])
    assert ctx_BLF.shape == (2, 24, 3 * 64) and final_BLD.shape == (2, 24, 64)
    # the reference formula: the mean over the hc_mult streams, as llama.cpp's build_hc_mean and vLLM's aux states
    want = torch.cat([states[0].sum(dim=2) / 4, states[2].sum(dim=2) / 4, final_BLD], dim=-1)
    torch.testing.assert_close(ctx_BLF, want, rtol=0, atol=1e-6)
    assert not torch.equal(ctx_BLF[..., 64:128], states[2][:, :, 0])  # not one stream: all four, averaged


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "deepseek_v4",
                                  pytest.param("smollm2", marks=pytest.mark.slow)])
def test_hooked_capture_equals_output_hidden_states(kind, tok):
    if kind == "smollm2":
        model, _ = tm.load_target(tm.resolve_target_path("smollm2"))
    else:
        model, _ = tm.tiny_moe_target(kind, seed=1, tokenizer=tok)
    num_layers = model.config.num_hidden_layers
    layers = [0, 1, num_layers - 1, num_layers, FINAL]
    ids_BL, mask_BL = _ids(length=16)
    states = _all_states(model, ids_BL, mask_BL)
    ctx_BLF, final_BLD = tm.capture_features(model, ids_BL, mask_BL, layers)
    want = torch.cat([tm.reduce_streams(states[i]) if i != FINAL else final_BLD for i in layers], dim=-1)
    assert ctx_BLF.dtype == torch.float32 and torch.equal(ctx_BLF, want), kind


def test_capture_keeps_only_the_sent_layers(tok, monkeypatch):
    model, _ = tm.tiny_moe_target("qwen3_moe", seed=1, tokenizer=tok)
    kept: list[int] = []
    real = tm.layer_states

    def counting(model, indices):
        ctx = real(model, indices)

        class Spy:
            def __enter__(self):
                self.states = ctx.__enter__()
                return self.states

            def __exit__(self, *exc):
                kept.append(len(self.states))
                return ctx.__exit__(*exc)
        return Spy()

    monkeypatch.setattr(tm, "layer_states", counting)
    seen_kwargs = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda **kw: seen_kwargs.append(kw) or forward(**kw))
    ids_BL, mask_BL = _ids(length=12)
    tm.capture_features(model, ids_BL, mask_BL, [2, FINAL])
    tm.capture_features(model, ids_BL, mask_BL, [FINAL])
    assert kept == [1]  # one state for [2, -1]; none at all for [-1] (the LM-head hook alone)
    assert [kw["output_hidden_states"] for kw in seen_kwargs] == [False, False]
    assert all(not h for layer in tm.decoder_layers(model) for h in (layer._forward_hooks, layer._forward_pre_hooks))


def _samples(n: int = 3) -> list[TokenizedSample]:
    rng = np.random.default_rng(0)
    return [TokenizedSample(i, rng.integers(0, 1000, size=8 + i), np.ones(8 + i, dtype=bool)) for i in range(n)]


def test_an_out_of_memory_forward_is_one_fatal_line(monkeypatch):
    worker = worker_mod.TargetWorker(tm.resolve_target_path("tiny-qwen3-moe"), [FINAL], max_tokens_per_forward=64)

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 88.00 GiB\nmore")

    monkeypatch.setattr(worker_mod, "capture_features", oom)
    with pytest.raises(OutOfMemory) as info:
        worker.encode(7, _samples())
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None
    assert message.startswith("target rank 0 ran out of GPU memory encoding batch 7 in a forward of 3 x 10 = 30 tokens")
    assert "target.max_tokens_per_forward (now 64)" in message and "Tried to allocate 88.00 GiB" in message

    # a group member raises it as a task error and keeps its process: not a lost member to restart
    member = group_mod.TargetGroupMember()
    member.rank, member._worker = 0, worker
    monkeypatch.setattr(group_mod.os, "_exit", lambda code: pytest.fail("the member exited on an OOM"))
    with pytest.raises(OutOfMemory):
        member.encode(7, _samples())


def test_a_group_ends_the_run_on_a_members_oom_instead_of_restarting(monkeypatch):
    group = group_mod.TargetGroup.__new__(group_mod.TargetGroup)
    group.index, group.size, group.restarts, group._fatal = 0, 2, 0, None
    group._target, group._tokens = {"max_restarts": 20}, ["rank1-done"]
    oom = OutOfMemory("target rank 1 ran out of GPU memory encoding batch 3 in a forward of ...")
    monkeypatch.setattr(group_mod.ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(group_mod.ray, "get", lambda ref: (_ for _ in ()).throw(oom))
    monkeypatch.setattr(group, "_start", lambda: pytest.fail("restarted the group on an OOM"), raising=False)
    for _ in range(2):  # and on every later call
        with pytest.raises(OutOfMemory, match="target rank 1 ran out of GPU memory"):
            group._restart_if_lost()
    assert group.restarts == 0


def test_members_see_the_nodes_gpus_and_bind_their_bundles(monkeypatch):
    gpu = group_mod.member_options({"CPU": 2.0, "GPU": 1.0}, {}, pg=None, rank=3)
    assert gpu["runtime_env"] == {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    assert gpu["num_gpus"] == 1.0 and gpu["scheduling_strategy"].placement_group_bundle_index == 3
    assert "runtime_env" not in group_mod.member_options({"CPU": 1.0}, {}, pg=None, rank=0)

    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(group_mod.ray, "get_gpu_ids", lambda: [5])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert group_mod.bind_gpu(5) == 5 and bound == [5] and os.environ["LOCAL_RANK"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a node started on a subset: its index among them
    assert group_mod.bind_gpu(1) == 1 and bound == [5, 1] and os.environ["LOCAL_RANK"] == "1"


def _encode_on_rank(rank: int, world: int, path: str) -> dict:
    """One member of a 2-rank gloo target group: how many FeatureBatches it built and host copies it made."""
    from workers.frozen_target.sharding import distributed_config

    counts = {"batches": 0, "host_copies": 0}
    real_batch, real_to = worker_mod.FeatureBatch, torch.Tensor.to

    def counting_batch(*args, **kwargs):
        counts["batches"] += 1
        return real_batch(*args, **kwargs)

    def counting_to(self, *args, **kwargs):
        if args and args[0] == "cpu":
            counts["host_copies"] += 1
        return real_to(self, *args, **kwargs)

    worker_mod.FeatureBatch = counting_batch
    torch.Tensor.to = counting_to
    member = group_mod.TargetGroupMember()
    member.rank = rank
    member._worker = worker_mod.TargetWorker(path, [1, FINAL], distributed=distributed_config(world, False),
                                             max_tokens_per_forward=64)
    batch, _ = member.encode(0, _samples())
    counts["returned"] = batch is not None
    return counts


@pytest.mark.slow  # two spawned processes loading the target: about 30 s on 2 cores
def test_only_rank_0_copies_its_features_to_the_host():
    path = str(tm.resolve_target_path("tiny-qwen3-moe"))
    rank0, rank1 = run_ranks(_encode_on_rank, 2, path, timeout=300)
    assert rank0 == {"batches": 1, "host_copies": 6, "returned": True}  # 3 samples x (context, final)
    assert rank1 == {"batches": 0, "host_copies": 0, "returned": False}
