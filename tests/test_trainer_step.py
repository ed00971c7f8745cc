"""One DeepSpeed optimizer step with gradient accumulation equals the gradient of the whole batch's loss,
(Σ numerators)/(Σ position weights): the trainer's loss scaling undoes DeepSpeed's GAS division exactly.

Run: python -m pytest tests/test_trainer_step.py -q
"""

from __future__ import annotations

import copy
import json
import os
import socket

import pytest
import torch
from draft_fixtures import dense_cfg, frozen_weights, make_batch

from draft_model.config import LossConfig
from draft_model.loss import output_loss
from draft_model.registry import build_draft
from pipeline.packing import PackStats
from workers.trainer.step import DraftWithLoss, MicroBatch, optimizer_step


@pytest.fixture(scope="module")
def single_rank_env():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _stats(bb) -> PackStats:
    n, k = bb.valid_NK.shape
    return PackStats(sample_ids=(), sequences_dropped=0, tokens=bb.input_ids_T.shape[0], blocks=n, block_size=k,
                     useful_block_tokens=int(bb.valid_NK.sum()))


def test_grad_accum_step_is_the_global_batch_gradient(single_rank_env):
    import deepspeed

    torch.manual_seed(0)
    cfg, loss_cfg = dense_cfg(block_size=4), LossConfig(chunk_rows=5)
    embed, head = frozen_weights()
    # two micro-batches of different sizes and validity, so unequal weight sums would expose a wrong scaling
    b1 = make_batch([12, 9], [(0, 3), (0, 9), (1, 5)], 4, feat_width=32, seed=1)
    b2 = make_batch([15], [(0, 2), (0, 6), (0, 12), (0, 13)], 4, feat_width=32, seed=2)
    module = DraftWithLoss(build_draft(cfg, embed, head), loss_cfg)
    reference = copy.deepcopy(module)

    # reference: plain autograd on the whole batch's loss
    parts = [output_loss(reference.draft(b), head, reference.draft.head_w2(), b.labels_NK(),
                         b.final_hidden_TD[b.target_index_NK()], b.valid_NK, loss_cfg) for b in (b1, b2)]
    total_w = sum(p.weight_sum for p in parts)
    loss = sum(loss_cfg.ce_weight * p.ce_sum + loss_cfg.tv_weight * p.tv_sum + loss_cfg.conf_weight * p.conf_sum
               for p in parts) / total_w
    loss.backward()
    grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    # DeepSpeed, grad_accum 2, plain SGD with lr 1: the update is minus the accumulated gradient
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 0},
        "gradient_clipping": 0.0, "steps_per_print": 10 ** 9})  # DeepSpeed clips at 1.0 unless told otherwise
    micro = [MicroBatch(b1, _stats(b1), 0), MicroBatch(b2, _stats(b2), 0)]
    acc, global_w = optimizer_step(engine, micro, loss_cfg.decay_lambda, world=1)
    assert global_w == pytest.approx(float(total_w), rel=1e-6)
    assert engine.global_steps == 1
    for n, p in engine.module.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), grads[n], rtol=1e-4, atol=1e-6, msg=n)
    assert acc["trained"] == int(b1.valid_NK.sum() + b2.valid_NK.sum())


def test_torch_engine_updates_exactly_like_deepspeed(single_rank_env):
    """workers/trainer/engines.TorchEngine (AdamW, clipping, WarmupCosineLR, accumulation, a head lr group) takes
    the DeepSpeed engine's steps, parameter for parameter, so single-process runs train the same drafts."""
    import deepspeed

    from pipeline.config import RunConfig
    from workers.trainer.engines import TorchEngine, deepspeed_config
    from workers.trainer.step import param_groups

    torch.manual_seed(0)
    cfg = RunConfig()
    cfg.draft, cfg.loss = dense_cfg(block_size=4), LossConfig(chunk_rows=5)
    t = cfg.train
    t.lr, t.head_lr_scale, t.max_steps, t.warmup_steps, t.grad_accum = 3e-2, 4.0, 7, 3, 2
    t.grad_clip, t.weight_decay, t.zero_stage, t.min_lr_ratio = 0.05, 0.01, 0, 0.2  # the clip binds
    embed, head = frozen_weights()
    batches = [make_batch([12, 9], [(0, 3), (0, 9), (1, 5)], 4, feat_width=32, seed=1),
               make_batch([15], [(0, 2), (0, 6), (0, 12), (0, 13)], 4, feat_width=32, seed=2)]
    micro = [MicroBatch(b, _stats(b), 0) for b in batches]
    module = DraftWithLoss(build_draft(cfg.draft, embed, head), cfg.loss)
    twin = copy.deepcopy(module)
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    groups = param_groups(module, cfg)
    assert [g["name"] for g in groups] == ["backbone", "head"]
    assert groups[1]["lr"] == pytest.approx(t.lr * t.head_lr_scale)

    engine, _, _, scheduler = deepspeed.initialize(model=module, model_parameters=groups,
                                                   config=deepspeed_config(cfg))
    ours = TorchEngine(twin, cfg)
    for step in range(t.max_steps):
        assert ours.get_lr() == pytest.approx(scheduler.get_lr(), abs=1e-12), step
        losses = [optimizer_step(e, micro, cfg.loss.decay_lambda, world=1)[0]["ce"] for e in (engine, ours)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5), step
    assert engine.global_steps == t.max_steps
    for (n, p), q in zip(engine.module.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(q.detach(), init[n]), f"{n} never moved"


@pytest.mark.parametrize("head_kind", ["markov", "rnn"])
def test_only_the_low_rank_table_gets_the_head_lr(head_kind):
    """train.head_lr_scale speeds up W1/W2 (W2 starts at zero); the RNN head's gate/cell/output layers are
    ordinary dense layers and train at the backbone's lr."""
    from pipeline.config import RunConfig
    from workers.trainer.step import param_groups

    cfg = RunConfig()
    cfg.draft, cfg.train.lr, cfg.train.head_lr_scale = dense_cfg(head=head_kind, rnn_state_size=24), 1e-3, 7.0
    embed, head = frozen_weights()
    module = DraftWithLoss(build_draft(cfg.draft, embed, head), LossConfig())
    groups = {g["name"]: g for g in param_groups(module, cfg)}
    names = {id(p): n for n, p in module.named_parameters()}
    head_names = sorted(names[id(p)] for p in groups["head"]["params"])
    assert head_names == ["draft.head.w1.weight", "draft.head.w2_RV"]
    assert groups["head"]["lr"] == pytest.approx(7e-3) and groups["backbone"]["lr"] == pytest.approx(1e-3)
    backbone = {names[id(p)] for p in groups["backbone"]["params"]}
    rnn_layers = {n for n in names.values() if n.startswith("draft.head.w_")}
    assert bool(rnn_layers) == (head_kind == "rnn") and rnn_layers <= backbone
    assert len(head_names) + len(backbone) == len(names)  # every trainable parameter in exactly one group


def test_torch_engine_checkpoint_resumes_bit_for_bit(tmp_path):
    """TorchEngine's checkpoint (through CheckpointManager: safetensors weights, optimizer/scheduler/RNG loaded with
    weights_only=True) restores a fresh engine so that its next steps equal an uninterrupted engine's exactly."""
    from pipeline.config import RunConfig
    from workers.trainer.checkpoint import CheckpointManager, write_manifest
    from workers.trainer.engines import TorchEngine

    cfg = RunConfig()
    cfg.draft, cfg.loss = dense_cfg(block_size=4), LossConfig(chunk_rows=5)
    cfg.train.lr, cfg.train.max_steps, cfg.train.warmup_steps, cfg.train.grad_accum = 1e-2, 6, 2, 2
    embed, head = frozen_weights()
    batches = [make_batch([12, 9], [(0, 3), (0, 9), (1, 5)], 4, feat_width=32, seed=1),
               make_batch([15], [(0, 2), (0, 6), (0, 12), (0, 13)], 4, feat_width=32, seed=2)]
    micro = [MicroBatch(b, _stats(b), 0) for b in batches]

    def engine(seed: int) -> TorchEngine:
        torch.manual_seed(seed)
        return TorchEngine(DraftWithLoss(build_draft(cfg.draft, embed, head), cfg.loss), cfg)

    straight = engine(0)
    for _ in range(3):
        optimizer_step(straight, micro, cfg.loss.decay_lambda, world=1)
    ckpts = CheckpointManager(tmp_path, keep_last=1)
    path = ckpts.save(straight, 3, {"config": cfg.to_dict(), "engine": "DeepSpeedEngine"}, 0, lambda: None)
    with pytest.raises(RuntimeError, match="holds DeepSpeedEngine state"):  # the other trainer's checkpoint
        ckpts.load(engine(1), path, 0)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "engine": "TorchEngine"}))
    write_manifest(path)  # a hand-edited checkpoint must be sealed again, or latest() rejects the edited meta.json
    assert sorted(p.name for p in (path / "ds").iterdir()) == ["model.safetensors", "optimizer.pt", "scheduler.pt"]
    resumed = engine(1)  # other initial weights: everything must come from the checkpoint
    assert ckpts.load(resumed, ckpts.latest(), 0)["step"] == 3
    for _ in range(3):
        a = optimizer_step(straight, micro, cfg.loss.decay_lambda, world=1)[0]
        b = optimizer_step(resumed, micro, cfg.loss.decay_lambda, world=1)[0]
        values = [{k: v for k, v in d.items() if not k.startswith("t_")} for d in (a, b)]  # not the phase clocks
        assert values[0] == values[1] and straight.get_lr() == resumed.get_lr()
    for (n, p), q in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(p, q), n


def test_host_weight_sum_equals_position_weights():
    """The loss denominator computed on the host from the packer's valid lengths equals the device one."""
    import numpy as np

    from draft_model.loss import position_weights
    from workers.trainer.step import host_weight_sum

    valid_NK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    for lam in (0.5, 4.0, 100.0):
        expect = float(position_weights(valid_NK, lam, dtype=torch.float64).sum())
        got = host_weight_sum(valid_NK.sum(-1).numpy(), 5, lam)
        assert abs(got - expect) < 1e-12 * expect, (lam, got, expect)
    assert host_weight_sum(np.zeros(3, dtype=np.int64), 5, 4.0) == 0.0


def _tiny_run_cfg():
    from pipeline.config import RunConfig

    cfg = RunConfig()
    cfg.draft, cfg.loss = dense_cfg(block_size=4), LossConfig(chunk_rows=5)
    cfg.train.lr, cfg.train.max_steps, cfg.train.warmup_steps = 1e-2, 6, 1
    return cfg


def test_torch_engine_bf16_autocast_keeps_fp32_master_weights():
    """train.precision=bf16 in the single-process engine is autocast: the forward's matmuls run in bf16 (its loss
    moves off the fp32 one, by about bf16's resolution), while the parameters and their update stay fp32."""
    from workers.trainer.engines import TorchEngine
    from workers.trainer.step import as_loss_parts

    cfg = _tiny_run_cfg()
    embed, head = frozen_weights()
    batch = make_batch([12, 9], [(0, 3), (0, 9), (1, 5)], 4, feat_width=32, seed=1)
    losses = {}
    for precision in ("fp32", "bf16"):
        cfg.train.precision = precision
        torch.manual_seed(0)
        engine = TorchEngine(DraftWithLoss(build_draft(cfg.draft, embed, head), cfg.loss), cfg)
        parts = as_loss_parts(engine(batch), cfg.loss)
        losses[precision] = float(parts.total(parts.weight_sum))
        before = [p.detach().clone() for p in engine.module.parameters()]
        for _ in range(3):  # DeepSpeed's schedule (which TorchEngine follows) starts with two zero-lr steps
            optimizer_step(engine, [MicroBatch(batch, _stats(batch), 0)], cfg.loss.decay_lambda, world=1)
        assert all(p.dtype == torch.float32 for p in engine.module.parameters())
        assert any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    assert losses["bf16"] != losses["fp32"]
    assert abs(losses["bf16"] - losses["fp32"]) < 3e-2 * abs(losses["fp32"])


@pytest.mark.slow
def test_compiled_draft_layers_match_eager():
    """train.compile: torch.compile of every backbone layer (applied from workers/) gives the eager loss and
    gradients, on two batches of different shapes (dynamic shapes, no recompile per batch)."""
    from workers.trainer.step import as_loss_parts, compile_draft

    cfg = _tiny_run_cfg()
    embed, head = frozen_weights()
    batches = [make_batch([12, 9], [(0, 3), (0, 9), (1, 5)], 4, feat_width=32, seed=1),
               make_batch([15, 7, 11], [(0, 2), (0, 6), (1, 3), (2, 8)], 4, feat_width=32, seed=2)]
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        module = DraftWithLoss(build_draft(cfg.draft, embed, head), cfg.loss)
        if compiled:
            assert compile_draft(module.draft) == cfg.draft.num_layers
        out = []
        for b in batches:
            parts = as_loss_parts(module(b), cfg.loss)
            loss = parts.total(parts.weight_sum)
            module.zero_grad()
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in module.parameters() if p.grad is not None]))
        results.append(out)
    for (l_eager, g_eager), (l_comp, g_comp) in zip(*results):
        torch.testing.assert_close(l_comp, l_eager, atol=1e-5, rtol=1e-5)
        for a, b in zip(g_comp, g_eager):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_quiet_deepspeed_silences_only_its_known_messages(capsys):
    """issue #47: DeepSpeed's known-harmless messages go, by their text; the rest of what it says still prints."""
    import logging
    import warnings

    pytest.importorskip("deepspeed")
    import importlib

    from workers.trainer.engines import SHM_NOTICE, quiet_deepspeed

    ds_comm = importlib.import_module("deepspeed.comm.torch")
    assert ds_comm.__name__ == "deepspeed.comm.torch"  # the module that prints it, not the torch package
    quiet_deepspeed()
    ds_comm.print(SHM_NOTICE)
    ds_comm.print("DeepSpeed another op built successfully")
    assert capsys.readouterr().out == "DeepSpeed another op built successfully\n"
    assert ds_comm.build_shm_op.__globals__["print"] is ds_comm.print  # what build_shm_op's print() calls
    kept = []
    handler = logging.Handler()
    handler.emit = lambda record: kept.append(record.getMessage())
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        logger.warning("Attempting to get learning rate from scheduler before it has started")
        logger.warning("Attempting something else")
    finally:
        logger.removeHandler(handler)
    assert kept == ["Attempting something else"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("default")  # what a test runner sets is replaced: quiet_deepspeed's filter goes first
        quiet_deepspeed()
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated.", FutureWarning, stacklevel=1)
    assert [str(w.message)[:40] for w in seen] == ["`torch.distributed.reduce_scatter_tensor"]
