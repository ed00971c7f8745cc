"""The trainer's host path, counted on a CPU: what crosses to the device per micro-batch (the final state once, pinned,
non-blocking, no concatenation copy), the NaN check deferred to the step's one host read, the host reads of a whole
optimizer step (none in the MoE or the decode), one MoE-load all-reduce per step, frozen weights kept in bf16 with
no per-micro-batch cast, and the next step's fetch overlapping this step's compute.

A host without CUDA cannot copy to `cuda`, so the copy counts patch `Tensor.to`: a copy onto `cuda` is recorded
(source, bytes, non_blocking, whether the source was pinned) and lands on `meta`, where the decode runs as it would
on the GPU. docs/gpu-feeding.md says what each test shows.

Run: python -m pytest tests/test_gpu_feeding.py -q
"""

from __future__ import annotations

import collections
import threading
import time
import traceback
from dataclasses import replace

import numpy as np
import pytest
import torch
from draft_fixtures import D, V, frozen_weights, tiny
from torch.utils._python_dispatch import TorchDispatchMode

from draft_model.config import LossConfig
from draft_model.loss import dspark_loss
from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from pipeline.config import RunConfig
from pipeline.contracts import FeatureBatch
from workers.trainer.step import DraftWithLoss, MicroBatch, check_features, optimizer_step, pack_micro_batch

# ---- a stand-in for the host-to-device copies ------------------------------------------------------------------


class Copies:
    """Patches Tensor.to / pin_memory: a copy onto `cuda` is recorded and returned on `meta`."""

    def __init__(self, monkeypatch) -> None:
        self.h2d: list[dict] = []
        self.pinned: set[int] = set()  # data_ptr of host tensors pinned (the patched pin returns the tensor itself)
        self.cats = 0
        to, cat = torch.Tensor.to, torch.cat

        def fake_to(t, *args, **kwargs):
            dev = kwargs.get("device")
            dtype = kwargs.get("dtype")
            for a in args:
                if isinstance(a, (str, torch.device)):
                    dev = a
                elif isinstance(a, torch.dtype):
                    dtype = a
            if dev is not None and torch.device(dev).type == "cuda" and t.device.type == "cpu":
                self.h2d.append({"shape": tuple(t.shape), "bytes": t.numel() * t.element_size(), "ptr": t.data_ptr(),
                                 "non_blocking": bool(kwargs.get("non_blocking")),
                                 "pinned": t.data_ptr() in self.pinned})
                return to(t, "meta", dtype=dtype)
            return to(t, *args, **kwargs)

        def fake_pin(t, *args, **kwargs):
            self.pinned.add(t.data_ptr())
            return t

        def counting_cat(*args, **kwargs):
            self.cats += 1
            return cat(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", fake_to)
        monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: False)
        monkeypatch.setattr(torch, "cat", counting_cat)

    def feature_copies(self, width: int) -> list[dict]:
        return [c for c in self.h2d if len(c["shape"]) == 2 and c["shape"][1] == width]


def _wire(T_S: list[int], ctx_width: int, ctx_is_final: bool, nan_row: int | None = None, seed: int = 0
          ) -> FeatureBatch:
    """A FeatureBatch as it comes off the object store (bf16 wire), every sequence long enough for a block."""
    g = torch.Generator().manual_seed(seed)
    T = sum(T_S)
    fin = torch.randn(T, D, generator=g).to(torch.bfloat16)
    if nan_row is not None:
        fin[nan_row, 2] = float("nan")
    ctx = torch.empty(T, 0, dtype=torch.bfloat16) if ctx_is_final else torch.randn(T, ctx_width, generator=g).to(
        torch.bfloat16)
    mask = torch.ones(T, dtype=torch.bool)
    seq_start = torch.tensor(np.concatenate([[0], np.cumsum(T_S)]))
    return FeatureBatch(5, tuple(range(len(T_S))), torch.randint(0, V, (T,), generator=g), mask, seq_start, ctx, fin,
                        ctx_is_final=ctx_is_final)


def _cfg(block_size: int = 4, anchors: int = 3) -> RunConfig:
    cfg = RunConfig()
    cfg.draft = replace(cfg.draft, block_size=block_size)
    cfg.data.anchors_per_seq, cfg.data.samples_per_batch = anchors, 2
    return cfg


# ---- what crosses per micro-batch --------------------------------------------------------------------------------


@pytest.mark.parametrize("ctx_is_final", [True, False])
def test_features_cross_once_pinned_non_blocking_without_a_concatenation(monkeypatch, ctx_is_final):
    fb = _wire([12, 9], ctx_width=3 * D, ctx_is_final=ctx_is_final)
    copies = Copies(monkeypatch)
    mb = pack_micro_batch(fb, 5, _cfg(), 100, torch.float32, torch.device("cuda"))
    bb = mb.batch
    T = fb.num_tokens
    final = copies.feature_copies(D)
    assert len(final) == 1 and final[0]["bytes"] == T * D * 2  # in the wire dtype: the decode runs after the copy
    ctx = copies.feature_copies(3 * D)
    assert len(ctx) == (0 if ctx_is_final else 1)
    assert all(c["non_blocking"] and c["pinned"] for c in copies.h2d)  # every copy: pinned source, asynchronous
    # the features crossed as the wire batch's own tensors: no host-side concatenation or index copy first
    assert copies.cats == 0 and final[0]["ptr"] == fb.final_hidden_TD.data_ptr()
    # decoded on the device, once: a context that is the final state stays one tensor
    assert bb.final_hidden_TD.device.type == "meta" and bb.final_hidden_TD.dtype == torch.float32
    assert (bb.ctx_feats_TF is bb.final_hidden_TD) == ctx_is_final
    assert mb.features_finite is not None and mb.features_finite.device.type == "meta"  # not read yet
    # what crossed is what the wire carried (features plus the small index tensors)
    assert sum(c["bytes"] for c in copies.h2d) >= fb.nbytes() - fb.seq_start_S1.numel() * 8


def test_dropped_rows_are_gathered_once_on_the_host(monkeypatch):
    """A sequence without an anchor (one token) is dropped: the kept rows are gathered once, still one copy each."""
    fb = _wire([12, 1, 9], ctx_width=0, ctx_is_final=True)
    copies = Copies(monkeypatch)
    mb = pack_micro_batch(fb, 5, _cfg(), 100, torch.bfloat16, torch.device("cuda"))
    (final,) = copies.feature_copies(D)
    assert final["bytes"] == 21 * D * 2 and mb.stats.sequences_dropped == 1
    assert mb.batch.ctx_feats_TF is mb.batch.final_hidden_TD and copies.cats == 0


# ---- a whole optimizer step: host reads and the deferred NaN check -----------------------------------------------


class _Engine:
    """The slice of the engine interface optimizer_step uses (no optimizer: the host path is what is counted)."""

    def __init__(self, module: DraftWithLoss) -> None:
        self.module = module

    def __call__(self, batch):
        return self.module(batch)

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor on the host or size a tensor by its data, by the project file calling."""

    OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.bincount")

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.OPS:
            frames = [f for f in traceback.extract_stack() if "/tests/" not in f.filename
                      and ("/draft_model/" in f.filename or "/workers/" in f.filename or "/pipeline/" in f.filename)]
            site = frames[-1].filename.rsplit("/", 2)[-2:] if frames else ["?", "?"]
            self.sites[(name, "/".join(site), frames[-1].name if frames else "?")] += 1
        return func(*args, **(kwargs or {}))


def _moe_module() -> DraftWithLoss:
    torch.manual_seed(0)
    cfg = tiny(draft_preset("v4"), num_layers=2)
    return DraftWithLoss(build_draft(cfg, *frozen_weights()), LossConfig(chunk_rows=7, matmul_dtype="float32"))


def _micro(module: DraftWithLoss, seeds=(0, 1), nan_row=None) -> list[MicroBatch]:
    cfg = _cfg(block_size=module.draft.cfg.block_size)
    F = len(module.draft.cfg.target_layers) * D
    return [pack_micro_batch(_wire([12, 9], F, ctx_is_final=False, nan_row=nan_row if s == seeds[-1] else None,
                                   seed=s), s, cfg, 100, torch.float32, torch.device("cpu")) for s in seeds]


def test_host_reads_of_a_step(monkeypatch):
    """One step of a 2-layer MoE draft over 2 micro-batches: no host read in the MoE, the decode or the packer's
    output; the loss sizes its rows from the packer's host count (no nonzero); the step's sums come back in one
    `.tolist()`."""
    module = _moe_module()
    micro = _micro(module)
    tolist = collections.Counter()
    real_tolist = torch.Tensor.tolist

    def counting_tolist(t):
        frame = [f for f in traceback.extract_stack()[:-1] if "/tests/" not in f.filename][-1]
        tolist[frame.filename.rsplit("/", 1)[-1] + ":" + frame.name] += 1
        return real_tolist(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    with HostReads() as reads:
        sums, _ = optimizer_step(_Engine(module), micro, module.loss_cfg.decay_lambda, world=1)
    assert all(np.isfinite(v) for v in sums.values())
    files = {site for _, site, _ in reads.sites}
    assert not any(f.endswith(("moe.py", "contracts.py", "packing.py", "batch.py")) for f in files), reads.sites
    assert not [k for k in reads.sites if k[0] == "aten.nonzero" and k[1].endswith("loss.py")], reads.sites
    assert not [k for k in reads.sites if k[0] == "aten.bincount"], reads.sites
    # step.py: the one read of the step's sums (all_reduce_sum's CPU list is not a device read); loss.py's
    # _check_inputs reads on the CPU only (a device-side assert elsewhere, test below)
    assert tolist["step.py:optimizer_step"] == 1
    assert tolist["loss.py:_check_inputs"] == len(micro)
    assert not any(k.startswith("moe.py") for k in tolist), tolist


def test_loss_input_checks_do_not_read_the_host_off_cpu(monkeypatch):
    """Off the CPU the loss's value checks are one device-side assert: no `.tolist()` per micro-batch."""
    from draft_model import loss as loss_module

    calls = []
    monkeypatch.setattr(torch, "_assert_async", lambda t, msg="": calls.append(msg))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: pytest.fail("host read in _check_inputs"))
    N, K = 3, 4
    h = torch.empty(N, K, D, device="meta")
    loss_module._check_inputs(h, torch.empty(V, D, device="meta"), torch.zeros(N, K, dtype=torch.long,
                                                                                  device="meta"),
                              h, torch.ones(N, K, dtype=torch.bool, device="meta"), None, None, None)
    assert len(calls) == 1 and "contiguous prefix" in calls[0]


def test_loss_with_the_host_count_equals_the_nonzero_path():
    torch.manual_seed(0)
    N, K = 5, 4
    valid = torch.arange(K)[None, :] < torch.tensor([4, 1, 3, 2, 4])[:, None]
    h, t = torch.randn(N, K, D), torch.randn(N, K, D)
    labels = torch.randint(0, V, (N, K))
    head = torch.randn(V, D) * D ** -0.5
    cfg = LossConfig(chunk_rows=3, matmul_dtype="float32")
    a = dspark_loss(h, head, labels, t, valid, cfg)
    b = dspark_loss(h, head, labels, t, valid, cfg, num_valid=int(valid.sum()))
    assert torch.equal(a.ce_sum, b.ce_sum) and torch.equal(a.tv_sum, b.tv_sum) and torch.equal(a.c_star_NK,
                                                                                              b.c_star_NK)


def test_non_finite_features_are_caught_at_the_step_read():
    """Packing a batch with a NaN does not read the host; the step's one read counts it and `check_features` names
    the batch and rows."""
    module = _moe_module()
    micro = _micro(module, nan_row=7)
    assert bool(micro[0].features_finite) and not bool(micro[1].features_finite)
    sums, _ = optimizer_step(_Engine(module), micro, module.loss_cfg.decay_lambda, world=1)
    assert sums["bad_features"] == 1.0
    with pytest.raises(ValueError, match=r"non-finite target final hidden states in batch 1 \(token rows \[7\]"):
        check_features(sums["bad_features"], micro, 1)


class _Batches:
    def __init__(self, micro: list[MicroBatch]) -> None:
        self.micro = micro

    def start(self, step: int) -> None:
        pass

    def take(self, step: int) -> list[MicroBatch]:
        return self.micro

    def close(self) -> None:
        pass


def _fit_with_nan_on_rank_1(rank: int, world: int) -> str:
    """One step of `fit` on a gloo rank; rank 1's second micro-batch carries a NaN. -> the error it raised."""
    import logging

    from pipeline.metrics import NullSink
    from workers.trainer.loop import fit

    module = _moe_module()
    cfg = _cfg(block_size=module.draft.cfg.block_size)
    cfg.train.max_steps, cfg.train.tensorboard = 1, False
    micro = _micro(module, nan_row=7 if rank == 1 else None)
    try:  # no checkpointer: a step that got past the check would fail to save
        fit(_Engine(module), _Batches(micro), None, NullSink(), cfg, rank, world, 0, logging.getLogger("t"))
    except ValueError as e:
        return str(e)
    return "no error"


def test_non_finite_features_on_one_rank_stop_every_rank():
    """The count rides on the step's metric all-reduce: both ranks raise (none waits out a collective timeout); the
    rank holding the batch names it."""
    from dist_helpers import run_ranks

    errors = run_ranks(_fit_with_nan_on_rank_1, 2, timeout=240)
    assert errors[1].startswith("non-finite target final hidden states in batch 1 (token rows [7]")
    assert errors[0].startswith("non-finite target features in 1 micro-batch(es) of step 1 on another trainer rank")


# ---- one MoE-load all-reduce per optimizer step ----------------------------------------------------------------


def test_moe_loads_are_all_reduced_once_per_step(monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from draft_model.moe import MoE
    from workers.trainer.step import setup_moe_balance

    module = _moe_module()
    setup_moe_balance(module.draft)
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    assert len(moes) == 2
    micro = _micro(module)
    reduced = []
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=2)
    try:
        real = dist.all_reduce

        def counting(t, *a, **k):
            reduced.append((tuple(t.shape), t.device.type, t.dtype))
            if t.dtype == torch.float32:  # the loads: the other replica routed the same way (a doubled load)
                t.mul_(2)
                return None
            return real(t, *a, **k)

        monkeypatch.setattr(dist, "all_reduce", counting)
        before = [m.router_bias_E.clone() for m in moes]
        optimizer_step(_Engine(module), micro, module.loss_cfg.decay_lambda, world=2)
    finally:
        dist.destroy_process_group()
    loads = [r for r in reduced if r[2] == torch.float32]
    E = moes[0].cfg.num_experts
    assert loads == [((2 * E,), "cpu", torch.float32)]  # both layers' loads, two micro-batches, one collective
    assert all(m.pending_load_E is None for m in moes)
    assert any(not torch.equal(b, m.router_bias_E) for b, m in zip(before, moes))


# ---- frozen weights in the training dtype ------------------------------------------------------------------------


def test_frozen_weights_stored_in_bf16_are_not_cast_per_micro_batch(monkeypatch):
    from workers.trainer.precision import frozen_dtype

    embed, _ = frozen_weights()
    draft = build_draft(tiny(draft_preset("v4"), num_layers=1), embed, embed, frozen_dtype=torch.bfloat16)
    assert draft.frozen_lm_head_VD.dtype == torch.bfloat16 and draft.frozen_lm_head_VD is draft.frozen_embed_VD
    assert build_draft(tiny(draft_preset("v4"), num_layers=1), embed, embed).frozen_embed_VD.dtype == torch.float32

    head = draft.frozen_lm_head_VD
    N, K = 3, 4
    copies = []
    real_to = torch.Tensor.to

    def recording_to(t, *a, **k):
        out = real_to(t, *a, **k)
        if t.shape == head.shape and out is not t:
            copies.append(out.dtype)
        return out

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    h = torch.randn(N, K, D, dtype=torch.bfloat16)
    dspark_loss(h, head, torch.zeros(N, K, dtype=torch.long), h, torch.ones(N, K, dtype=torch.bool),
                LossConfig(chunk_rows=4, matmul_dtype="bfloat16"))
    assert copies == []  # no V x D copy per micro-batch
    dspark_loss(h, head.float(), torch.zeros(N, K, dtype=torch.long), h, torch.ones(N, K, dtype=torch.bool),
                LossConfig(chunk_rows=4, matmul_dtype="bfloat16"))
    assert copies == [torch.bfloat16]  # an fp32 head is cast on every call: what the bf16 buffer avoids

    cfg = RunConfig()
    cfg.train.precision, cfg.loss = "bf16", replace(cfg.loss, matmul_dtype="bfloat16")
    assert frozen_dtype(cfg) == torch.bfloat16
    cfg.loss = replace(cfg.loss, matmul_dtype="float32")  # fp32 vocabulary matmuls asked for: the head stays fp32
    assert frozen_dtype(cfg) is None
    cfg.train.precision = "fp32"
    assert frozen_dtype(cfg) is None


# ---- the next step is fetched while this one computes ---------------------------------------------------------------


def test_next_step_is_made_while_this_one_computes():
    from workers.trainer.prefetch import OneStepAhead

    events, fetch_s, compute_s = [], 0.3, 0.45
    t0 = time.perf_counter()

    def make(step):
        events.append(("fetch begins", step, time.perf_counter() - t0, threading.current_thread().name))
        time.sleep(fetch_s)  # a slow feature source
        return [step]

    ahead = OneStepAhead(make, torch.device("cpu"))
    try:
        ahead.start(0)
        waits = []
        for step in range(3):
            w0 = time.perf_counter()
            assert ahead.take(step) == [step]
            waits.append(time.perf_counter() - w0)
            if step + 1 < 3:
                ahead.start(step + 1)
            c0 = time.perf_counter() - t0
            time.sleep(compute_s)  # this step's compute
            events.append(("compute", step, c0, threading.current_thread().name))
    finally:
        ahead.close()
    assert waits[0] >= fetch_s * 0.9  # nothing to overlap the first fetch with
    assert max(waits[1:]) < 0.1, waits  # the later ones were ready when asked for
    begins = {s: t for kind, s, t, _ in events if kind == "fetch begins"}
    computes = {s: t for kind, s, t, _ in events if kind == "compute"}
    assert all(begins[s + 1] < computes[s] + 0.05 for s in range(2))  # s+1's fetch began as s's compute did
    assert all(name.startswith("prefetch") for kind, _, _, name in events if kind == "fetch begins")


@pytest.mark.parametrize("device, expected", [("cuda:1", [1]), ("cuda", []), ("cpu", [])])
def test_the_prefetch_thread_works_on_the_trainers_device(monkeypatch, device, expected):
    """A new thread starts on CUDA device 0: the prefetch thread is put on the trainer's before it copies anything."""
    from workers.trainer.prefetch import OneStepAhead

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name)))
    ahead = OneStepAhead(lambda step: [step], torch.device(device))
    try:
        ahead.start(0)
        assert ahead.take(0) == [0]
    finally:
        ahead.close()
    assert [d for d, _ in calls] == expected and all(name.startswith("prefetch") for _, name in calls)


def test_feature_service_fetch_and_pack_run_on_the_prefetch_thread(monkeypatch):
    """FeatureServiceBatches: the object fetch (ray.wait with fetch_local, then ray.get) and the packing run on the
    background thread, started by `start`, before `take` is called."""
    import ray

    from workers.trainer import ray_trainer

    log = []
    wire = _wire([12, 9], 0, ctx_is_final=True)

    class Service:
        class get:  # noqa: N801 - Ray's handle.method.remote shape
            @staticmethod
            def remote(b):
                return ("call", b)

    def fake_get(obj, timeout=None):
        log.append(("get", obj, threading.current_thread().name))
        time.sleep(0.05)
        return [("ref", obj[1])] if obj[0] == "call" else wire

    def fake_wait(refs, timeout=None, fetch_local=False):
        log.append(("wait", refs[0], fetch_local, threading.current_thread().name))
        return refs, []

    monkeypatch.setattr(ray, "get", fake_get)
    monkeypatch.setattr(ray, "wait", fake_wait)
    cfg = _cfg()
    cfg.train.grad_accum = 2
    batches = ray_trainer.FeatureServiceBatches(Service(), cfg, 0, 1, 100, torch.device("cpu"))
    try:
        batches.start(0)
        time.sleep(0.5)  # "the previous step computes"
        fetched_before_take = len([e for e in log if e[0] == "get"])
        w0 = time.perf_counter()
        micro = batches.take(0)
        wait = time.perf_counter() - w0
    finally:
        batches.close()
    assert fetched_before_take == 4 and wait < 0.1  # two micro-batches: the call and the data each
    assert [m.batch_index for m in micro] == [0, 1]
    assert all(e[-1].startswith("features") for e in log)
    assert [e[2] for e in log if e[0] == "wait"] == [True, True]  # pulled to this node before the get


@pytest.mark.slow  # starts a local Ray instance: about 20 s on 2 cores
def test_ray_get_maps_the_features_from_the_object_store(local_ray):
    """Through a real Ray object store the trainer's feature tensors are views of its shared memory (the
    FeatureBatch pickles as numpy, out of band), not a copy out of the pickle on the heap."""
    def mapping(ptr: int) -> str:
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= ptr < hi:
                    return (line.split()[5:] or ["anon"])[0]
        return "?"

    wire = _wire([30000, 20000], 0, ctx_is_final=True)  # 3.2 MB of features: a plasma object, not inlined
    out = local_ray.get(local_ray.put(wire))
    assert torch.equal(out.final_hidden_TD, wire.final_hidden_TD)
    assert "plasma" in mapping(out.final_hidden_TD.data_ptr()), mapping(out.final_hidden_TD.data_ptr())
