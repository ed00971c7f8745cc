"""The trainers' collectives under a process group that serves only cuda, as NCCL does, and a trainer step that runs
out of GPU memory: both on a CPU-only machine.

torch's fake process group registered for cuda only (`init_process_group(backend="cuda:fake", ...)`) refuses a CPU
tensor with NCCL's own error ("No backend type associated with device type cpu"), and FakeTensorMode makes `cuda`
tensors without a GPU, so the step's, the loop's and the elastic resume's collectives are checked for their
device here. FakeTensorMode answers a collective on a fake tensor itself, whatever its device, so `nccl_like`
hands every all_reduce of a non-cuda tensor to the group as a real tensor first: the group's own refusal is what
fails. A FakeTensor holds no values: `tolist` is stubbed to zeros, and the fake group reduces nothing.

Run: python -m pytest -q tests/test_gpu_collectives.py
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from draft_fixtures import make_batch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore

from pipeline.config import RunConfig
from pipeline.metrics import NullSink
from pipeline.packing import PackStats
from workers.oom import OutOfMemory
from workers.trainer import loop, reshard, step
from workers.trainer.collective import backend_devices, collective_device
from workers.trainer.step import MicroBatch, all_reduce_sum, optimizer_step


@pytest.fixture
def nccl_like(monkeypatch):
    """A world of 2 whose backend serves cuda only, fake cuda tensors, and device 0 as the current GPU."""
    dist.init_process_group(backend="cuda:fake", store=FakeStore(), rank=0, world_size=2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    real_all_reduce = dist.all_reduce

    def as_the_group_sees_it(t, *args, **kwargs):
        if t.device.type != "cuda":
            with unset_fake_temporarily():  # a real tensor on that device: the group's own refusal, if any
                real_all_reduce(torch.zeros(t.shape, dtype=t.dtype, device=t.device.type), *args, **kwargs)
        return real_all_reduce(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", as_the_group_sees_it)
    monkeypatch.setattr(FakeTensor, "tolist", lambda self: np.zeros(self.shape).tolist())
    try:
        with FakeTensorMode():
            yield
    finally:
        dist.destroy_process_group()


def test_the_device_follows_the_backend(nccl_like):
    assert backend_devices() == {"cuda"} and collective_device() == torch.device("cuda", 0)
    assert all_reduce_sum([1.0, 2.0]) == [0.0, 0.0]  # the fake group returns at once: it ran, on cuda
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.zeros(1, dtype=torch.float64))  # what today's CPU tensor met


def test_gloo_and_no_group_stay_on_the_host():
    assert collective_device() == torch.device("cpu")  # one process: no group
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert "cpu" in backend_devices() and collective_device() == torch.device("cpu")
    finally:
        dist.destroy_process_group()


class _Reached(Exception):
    """The stub engine's forward: the step got past its first collective."""


class _StubEngine:
    module = SimpleNamespace(loss_cfg=SimpleNamespace(), modules=lambda: [])

    def __call__(self, batch):
        raise _Reached

    def get_lr(self):
        return [1e-3]


def _micro(b: int = 0) -> MicroBatch:
    """A real packed batch (made outside any fake mode), its host index built: Σw needs no device value."""
    with unset_fake_temporarily():
        bb = make_batch([10, 8], [(0, 0), (1, 3)], 4, feat_width=16, seed=b)
        bb.host_index()
        n, k = bb.valid_NK.shape
        stats = PackStats(sample_ids=(), sequences_dropped=0, tokens=18, blocks=n, block_size=k,
                          useful_block_tokens=int(bb.valid_NK.sum()))
    return MicroBatch(bb, stats, 0, b)


def test_the_steps_weight_all_reduce_runs_on_cuda(nccl_like, monkeypatch):
    micro = [_micro()]
    monkeypatch.setattr(step, "host_weight_sum", lambda *args: 1.0)  # host numpy math, no collective: not faked
    with pytest.raises(_Reached):
        optimizer_step(_StubEngine(), micro, 4.0, world=2)


class _OneStep:
    def start(self, step: int) -> None:
        pass

    def take(self, step: int) -> list:
        return [_micro(step)]

    def close(self) -> None:
        pass


def _cfg() -> RunConfig:
    cfg = RunConfig()
    cfg.train.max_steps, cfg.train.tensorboard = 1, False
    return cfg


def _sums(engine, micro, decay_lambda, world):
    keys = ("ce", "tv", "conf", "aux", "trained", "wire", "useful", "computed", "tau_sum", "blocks", "t_forward",
            "t_backward", "t_optimizer", "bad_features")
    return dict.fromkeys(keys, 0.0), 1.0


def test_the_loops_metric_all_reduce_runs_on_cuda(nccl_like, monkeypatch):
    monkeypatch.setattr(loop, "optimizer_step", _sums)
    saved = []
    monkeypatch.setattr(loop, "save_checkpoint", lambda *a, **k: saved.append(a[4]) or "ckpt")
    result = loop.fit(_StubEngine(), _OneStep(), None, NullSink(), _cfg(), 0, 2, 0, logging.getLogger("t"))
    assert saved == [1] and result.metrics is not None and result.metrics["trained_tokens"] == 0.0


def test_elastic_resumes_all_reduce_runs_on_cuda(nccl_like, tmp_path):
    ckpt = tmp_path / "step_4"
    ckpt.mkdir()
    meta = {"step": 4, "data_position": {"world_size": 4, "grad_accum": 1}, "config": {"train": {"zero_stage": 2}}}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    cfg = _cfg()
    cfg.train = replace(cfg.train, zero_stage=2)
    cfg.checkpoint.run_dir = str(tmp_path)
    # rank 1: rank 0 converts, every rank then agrees through the all-reduce whether that failed
    out = reshard.universal_source(ckpt, cfg, rank=1, world=2)
    assert out == tmp_path / reshard.RESHARD_DIR / "step_4"


def test_out_of_memory_in_a_step_is_fatal_and_one_line(monkeypatch):
    from workers.trainer.ray_trainer import FATAL_ERRORS

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.31 GiB\nmore detail")

    monkeypatch.setattr(loop, "optimizer_step", oom)
    cfg = _cfg()
    with pytest.raises(OutOfMemory) as info:
        loop.fit(_StubEngine(), _OneStep(), None, NullSink(), cfg, 3, 4, 0, logging.getLogger("t"))
    message = str(info.value)
    n, t = _micro(0).batch.valid_NK.shape[0], _micro(0).batch.input_ids_T.shape[0]
    assert "\n" not in message and info.value.__cause__ is None
    assert message.startswith("trainer rank 3 ran out of GPU memory in step 1")
    assert f"({n} blocks, {t} tokens)" in message and "Tried to allocate 8.31 GiB" in message
    assert f"data.anchors_per_seq ({cfg.data.anchors_per_seq}" in message and "data.samples_per_batch" in message
    # fatal: recorded once, never handed to Ray Train's restart of the group
    assert isinstance(info.value, FATAL_ERRORS)


class _OutOfMemoryInPrefetch(_OneStep):
    def take(self, step: int) -> list:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")


def test_out_of_memory_in_the_prefetch_is_fatal_and_one_line():
    """The prefetch thread copies and decodes on the device: its OOM, raised by `take`, is as fatal as the step's."""
    from workers.trainer.ray_trainer import FATAL_ERRORS

    cfg = _cfg()
    with pytest.raises(OutOfMemory) as info:
        loop.fit(_StubEngine(), _OutOfMemoryInPrefetch(), None, NullSink(), cfg, 1, 2, 0, logging.getLogger("t"))
    message = str(info.value)
    assert "\n" not in message and info.value.__cause__ is None and isinstance(info.value, FATAL_ERRORS)
    assert message.startswith("trainer rank 1 ran out of GPU memory fetching step 1's micro-batches")
    assert "Tried to allocate 2.00 GiB" in message
    assert f"data.anchors_per_seq ({cfg.data.anchors_per_seq}" in message and "data.samples_per_batch" in message
