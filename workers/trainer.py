"""Draft trainer workers: the Ray Train (TorchTrainer) loop that runs a DeepSpeed engine on packed blocks.

Per optimizer step, rank r of R fetches its `grad_accum` feature batches from the FeatureService (batch indices
from pipeline/order.py), packs them into BlockBatches, all-reduces the loss denominator (Σ position weights, known
from the valid masks before any forward), then runs forward/backward per micro-batch and one ZeRO step. The LM
head is applied here, locally, at the block positions only (inside the chunked loss). The step itself (loss
scaling, metrics) is workers/train_step.py, shared with the single-process trainer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
import torch.distributed as dist

from draft_model.batch import BlockBatch
from draft_model.registry import build_draft
from pipeline.config import RunConfig, config_from_dict
from pipeline.metrics import JsonlSink, MultiSink, NullSink, TensorBoardSink, get_logger
from pipeline.order import batch_index_for
from pipeline.packing import PackStats
from workers.checkpoint import CheckpointManager, export_draft
from workers.train_step import (
    DraftWithLoss,
    all_reduce_sum,
    export_meta,
    format_step,
    optimizer_step,
    pack_micro_batch,
    param_groups,
    share_moe_load,
    step_metrics,
)


def deepspeed_config(cfg: RunConfig) -> dict[str, Any]:
    t = cfg.train
    return {
        "train_micro_batch_size_per_gpu": 1,  # one packed batch per micro-step; its size is set by data.*
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        # torch's AdamW: no C++ op build on machines without a prebuilt FusedAdam
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.max_steps, "warmup_num_steps": max(t.warmup_steps, 1),
            "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr_ratio, "warmup_type": "linear"}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def train_loop(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: one call per trainer rank."""
    import deepspeed

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = get_logger("dspark.trainer", rank)
    cfg = config_from_dict(loop_config["config"])
    service = loop_config["service"]
    num_samples = loop_config["num_samples"]
    torch.manual_seed(cfg.train.seed)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.use_gpu else torch.device("cpu")

    embed_VD, lm_head_VD = ray.get(loop_config["weights_ref"])
    draft = build_draft(cfg.draft, embed_VD, lm_head_VD)
    share_moe_load(draft)
    module = DraftWithLoss(draft, cfg.loss)
    if cfg.train.zero_stage == 3 and draft.head_w2() is not None:
        deepspeed.zero.register_external_parameter(module, draft.head_w2())
    engine, _, _, scheduler = deepspeed.initialize(
        model=module, model_parameters=param_groups(module, cfg),
        config=deepspeed_config(cfg), dist_init_required=not dist.is_initialized())

    ckpts = CheckpointManager(cfg.checkpoint.run_dir, cfg.checkpoint.keep_last)
    start_step = 0
    resume = loop_config.get("resume_from")
    if resume:
        meta = ckpts.load(engine, Path(resume), rank)
        start_step = int(meta["step"])
        log.info("resumed from %s at step %d", resume, start_step)

    sink = NullSink()
    if rank == 0:
        sinks = [JsonlSink(os.path.join(cfg.checkpoint.run_dir, "metrics.jsonl"))]
        if cfg.train.tensorboard:
            sinks.append(TensorBoardSink(os.path.join(cfg.checkpoint.run_dir, "tensorboard")))
        sink = MultiSink(*sinks)
    bar = None
    if rank == 0:
        from ray.experimental import tqdm_ray

        bar = tqdm_ray.tqdm(total=cfg.train.max_steps, desc="train steps")
        bar.update(start_step)

    def barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    t_start = time.time()
    for step in range(start_step, cfg.train.max_steps):
        t0 = time.time()
        micro: list[tuple[BlockBatch, PackStats, int]] = []
        for m in range(cfg.train.grad_accum):
            b = batch_index_for(step, m, rank, cfg.train.grad_accum, world)
            (ref,) = ray.get(service.get.remote(b))
            micro.append(pack_micro_batch(ray.get(ref), b, cfg, num_samples, dtype, device))
        t_data = time.time() - t0

        acc, global_w = optimizer_step(engine, micro, cfg.loss.decay_lambda, world)
        metrics = step_metrics(all_reduce_sum(list(acc.values())), global_w, cfg, world, time.time() - t0, t_data,
                               scheduler.get_lr()[0] if scheduler is not None else cfg.train.lr, step + 1)
        if rank == 0:
            sink.log(step + 1, metrics)
            if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.max_steps:
                eta = (time.time() - t_start) / (step + 1 - start_step) * (cfg.train.max_steps - step - 1)
                log.info("%s", format_step(step + 1, cfg.train.max_steps, metrics, eta))
            bar.update(1)
        if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == cfg.train.max_steps:
            meta = {"data_position": {"next_batch_index": batch_index_for(step + 1, 0, 0, cfg.train.grad_accum, world),
                                      "world_size": world, "grad_accum": cfg.train.grad_accum},
                    "config": cfg.to_dict(), "metrics": metrics}
            path = ckpts.save(engine, step + 1, meta, rank, barrier)
            if rank == 0:
                log.info("checkpoint %s", path)

    if cfg.checkpoint.export:
        _export(engine, cfg, rank, barrier)
    sink.close()
    if bar is not None:
        bar.close()


def _export(engine: Any, cfg: RunConfig, rank: int, barrier: Any) -> None:
    import deepspeed

    draft = engine.module.draft
    params = list(draft.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=cfg.train.zero_stage == 3):
        if rank == 0:
            state = {k: v.float() for k, v in draft.state_dict().items()}
            out = export_draft(state, export_meta(cfg), os.path.join(cfg.checkpoint.run_dir, "export"))
            get_logger("dspark.trainer", rank).info("exported the draft to %s", out)
    barrier()
