"""Target groups on a real local Ray cluster (CPU, gloo): a TP = 2 group, and a TP = 2 + EP = 2 group, of tiny random
Qwen3-MoE and DeepSeek-V3 targets capture the same features (context layers and the final pre-LM-head state) and
embedding weights as the unsharded target; two groups serve alternate batches; a group that loses a member
(SIGKILL) is rebuilt whole and re-runs the batch; the sharding checks and config validation reject group shapes the
model or the cluster cannot take.

Run: python -m pytest tests/test_target_group.py -q     (about 1 minute on 2 cores: Qwen3-MoE's group and the
     checks; -m slow adds DeepSeek-V3, the killed member and the two groups, about 3 minutes)
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import ray
import torch

from pipeline.config import ConfigError, load_config
from pipeline.contracts import TokenizedSample
from pipeline.errors import InputError
from pipeline.order import batch_sample_ids
from pipeline.sample_store import write_samples
from workers.driver import check_cluster_fits
from workers.frozen_target.feature_service import FeatureService
from workers.frozen_target.group import TargetGroup
from workers.frozen_target.model import resolve_target_path
from workers.frozen_target.sharding import check_sharding
from workers.frozen_target.worker import TargetWorker

LAYERS = [1, 2, -1]


RAY_CPUS = 4  # the local_ray fixture's cluster (tests/conftest.py): two groups of two members


def _samples(n: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(0)
    return [TokenizedSample(i, rng.integers(0, 1000, size=9 + 3 * (i % 4)), np.ones(9 + 3 * (i % 4), dtype=bool))
            for i in range(n)]


def _target(name: str, tp_size: int = 2, expert_parallel: bool = False, max_restarts: int = 2) -> dict:
    return {"resolved_path": str(resolve_target_path(name)), "dtype": "float32", "wire_dtype": "float32",
            "num_workers": 1, "tp_size": tp_size, "expert_parallel": expert_parallel, "cpus_per_worker": 1.0,
            "gpus_per_worker": 0.0, "device_map": "", "resources_per_worker": {}, "max_tokens_per_forward": 64,
            "max_restarts": max_restarts, "batch_timeout_s": 120.0}


# the tiny MoE target of the default runs in the default suite; DeepSeek-V3's (MLA held whole) under -m slow
@pytest.mark.parametrize("name", ["tiny-qwen3-moe", pytest.param("tiny-deepseek-v3", marks=pytest.mark.slow)])
def test_sharded_group_features_equal_the_unsharded_target(local_ray, name):
    samples = _samples(6)  # max_tokens_per_forward=64: several micro-batches, padded ones among them
    ref_worker = TargetWorker(resolve_target_path(name), LAYERS, wire_dtype="float32", max_tokens_per_forward=64)
    want = ref_worker.encode(3, samples)
    want_embed, want_head = ref_worker.embedding_weights()
    for expert_parallel in (False, True):
        group = TargetGroup(0, _target(name, expert_parallel=expert_parallel), LAYERS)
        try:
            got = ray.get(group.encode.remote(3, samples), timeout=180)
            embed, head = ray.get(group.embedding_weights.remote(), timeout=60)
            assert ray.get(group.info.remote()) == ref_worker.info()
        finally:
            group.kill()
        assert got.sample_ids == want.sample_ids and torch.equal(got.input_ids_T, want.input_ids_T)
        assert torch.equal(got.seq_start_S1, want.seq_start_S1)
        assert got.ctx_feats_TF.shape == want.ctx_feats_TF.shape == (want.input_ids_T.shape[0], 3 * 64)
        ctx_err = (got.ctx_feats_TF - want.ctx_feats_TF).abs().max().item()
        fin_err = (got.final_hidden_TD - want.final_hidden_TD).abs().max().item()
        assert ctx_err <= 1e-5 and fin_err <= 1e-5, (name, expert_parallel, ctx_err, fin_err)
        # the weights the trainers' draft shares with the target come back whole
        assert torch.equal(embed, want_embed) and torch.equal(head, want_head)


@pytest.mark.slow
def test_a_killed_member_restarts_its_whole_group_and_the_batch_is_rerun(local_ray, tmp_path):
    samples = _samples(12)
    path = write_samples(samples, tmp_path / "samples.parquet")
    svc = FeatureService.remote(str(path), _target("tiny-qwen3-moe"), LAYERS, 3, 7, 1)
    try:
        first = ray.get(ray.get(svc.get.remote(0))[0], timeout=180)
        ((m0, m1),) = ray.get(svc.workers.remote())
        old = [ray.get(m.pid.remote()) for m in (m0, m1)]
        os.kill(old[1], signal.SIGKILL)  # rank 1 crashes; rank 0 is left mid-group
        # the trainer's path (workers/trainer/ray_trainer.py): a batch whose ref died is asked for again. Batch 1 may
        # have been produced before the kill; the next ones run into the dead member, fail, and are asked for again
        retried = 0
        for b in (1, 2, 3):
            for attempt in range(4):
                try:
                    fb = ray.get(ray.get(svc.get.remote(b))[0], timeout=180)
                    break
                except ray.exceptions.RayActorError:
                    assert attempt < 3
                    retried += 1
            assert fb.sample_ids == tuple(batch_sample_ids(b, 12, 3, 7))
        assert retried >= 1
        ((n0, n1),) = ray.get(svc.workers.remote())
        new = [ray.get(m.pid.remote()) for m in (n0, n1)]
        assert not set(new) & set(old)  # both members are new processes: the group restarted whole
        # and the rebuilt group computes what the first one did
        rerun = ray.get(ray.get(svc.get.remote(0))[0], timeout=180)
        assert torch.equal(rerun.final_hidden_TD, first.final_hidden_TD)
    finally:
        ray.get(svc.shutdown.remote())
        ray.kill(svc)


@pytest.mark.slow
def test_two_groups_side_by_side_serve_alternate_batches(local_ray, tmp_path):
    samples = _samples(12)
    path = write_samples(samples, tmp_path / "samples.parquet")
    svc = FeatureService.remote(str(path), {**_target("tiny-qwen3-moe"), "num_workers": 2}, LAYERS, 3, 7, 2)
    ref_worker = TargetWorker(resolve_target_path("tiny-qwen3-moe"), LAYERS, wire_dtype="float32",
                              max_tokens_per_forward=64)
    try:
        assert [len(g) for g in ray.get(svc.workers.remote())] == [2, 2]
        for b in range(4):  # round robin: batches 0, 2 on group 0; 1, 3 on group 1
            got = ray.get(ray.get(svc.get.remote(b))[0], timeout=180)
            want = ref_worker.encode(b, [samples[i] for i in batch_sample_ids(b, 12, 3, 7)])
            assert got.sample_ids == want.sample_ids
            assert (got.final_hidden_TD - want.final_hidden_TD).abs().max().item() <= 1e-5
    finally:
        ray.get(svc.shutdown.remote())
        ray.kill(svc)


def test_single_process_refuses_a_group(tmp_path):
    import logging

    from workers.trainer.single_process import train_single_process

    cfg = load_config(None, ["target.tp_size=2", f"checkpoint.run_dir={tmp_path}"])
    with pytest.raises(InputError, match=r"^the single-process trainer holds the whole target in this process: "
                                         r"target.tp_size"):
        train_single_process(cfg, logging.getLogger("test"), device="cpu")


def _config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(resolve_target_path(name)))


def test_sharding_checks_name_what_does_not_divide():
    qwen, dsv3 = _config("tiny-qwen3-moe"), _config("tiny-deepseek-v3")  # 4 heads, 2 KV heads (Qwen), 4 experts
    check_sharding(qwen, 2, True)
    check_sharding(dsv3, 2, True)
    with pytest.raises(ValueError, match=r"^target.tp_size=4 does not divide the target's num_key_value_heads \(2\)"):
        check_sharding(qwen, 4, False)
    with pytest.raises(ValueError, match=r"tp_size=8 does not divide the target's num_local_experts \(4\)"):
        check_sharding(dsv3, 8, True)  # MLA attention is not split by DeepSeek-V3's plan, the experts are
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the target's moe_intermediate_size \(32\)"):
        check_sharding(dsv3, 3, False)
    from transformers import GPT2Config, LlamaConfig

    with pytest.raises(ValueError, match=r"\(llama\) has no expert-parallel plan"):
        check_sharding(LlamaConfig(), 2, True)
    no_plan = GPT2Config()
    if not getattr(no_plan, "base_model_tp_plan", None):
        with pytest.raises(ValueError, match=r"\(gpt2\) has no tensor-parallel plan"):
            check_sharding(no_plan, 2, False)


@pytest.mark.parametrize("override, message", [
    ("target.tp_size=0", "target.tp_size must be >= 1"),
    ("target.expert_parallel=true", "target.expert_parallel needs target.tp_size > 1"),
])
def test_config_rejects_bad_group_settings(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])
    with pytest.raises(ValueError, match="gpus_per_worker must be 0 .CPU. or 1"):
        load_config(None, ["target.tp_size=2", "target.gpus_per_worker=2"])
    with pytest.raises(ValueError, match="device_map must be empty"):
        load_config(None, ["target.tp_size=2", "target.device_map=auto"])
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(None, ["target.ep_size=2"])


def test_cluster_check_refuses_more_gpus_than_there_are():
    cfg = load_config(None, ["target.num_workers=2", "target.tp_size=8", "target.gpus_per_worker=1",
                             "cluster.num_trainers=8", "cluster.use_gpu=true"])
    node = {"CPU": 64.0, "GPU": 8.0}
    check_cluster_fits(cfg, [node] * 3)  # 2 groups of 8 + 8 trainers = 24 GPUs
    with pytest.raises(InputError, match=r"^the run needs 24 GPUs .* but the Ray cluster has 16$"):
        check_cluster_fits(cfg, [node] * 2)
    with pytest.raises(InputError, match=r"^a target group needs 8 GPUs on one node .* the largest node has 4$"):
        check_cluster_fits(cfg, [{"CPU": 64.0, "GPU": 4.0}] * 8)
