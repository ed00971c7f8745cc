"""Draft trainer workers: the Ray Train (TorchTrainer) entry point that runs a DeepSpeed engine on packed blocks.

Rank r of R builds the draft, its DeepSpeed engine and a `FeatureServiceBatches` source, then runs the shared loop
(workers/trainer/loop.py): per optimizer step it fetches its `grad_accum` feature batches from the FeatureService
(batch indices from pipeline/order.py) while the previous step computes, packs them into BlockBatches and runs
`optimizer_step` (workers/trainer/step.py): one ZeRO step. The LM head is applied here, locally, at the block
positions only (inside the chunked loss).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, NamedTuple

import ray
import ray.train
import torch
import torch.distributed as dist
from torch import nn

from draft_model.registry import build_draft
from pipeline.config import RunConfig, config_from_dict
from pipeline.export import export_draft, export_meta
from pipeline.metrics import JsonlSink, MultiSink, NullSink, TensorBoardSink, get_logger
from pipeline.order import batch_index_for
from workers.preemption import stop_on_signal
from workers.run_control import StopPoller
from workers.trainer.checkpoint import CheckpointError, CheckpointManager
from workers.trainer.ledger import Ledger
from workers.trainer.loop import MicroBatch, all_gather, barrier, fit, resume, resume_ledger
from workers.trainer.reshard import load_universal, universal_source
from workers.trainer.step import (
    DraftWithLoss,
    compile_draft,
    pack_micro_batch,
    param_groups,
    setup_moe_balance,
)


def deepspeed_config(cfg: RunConfig, load_universal: bool = False) -> dict[str, Any]:
    t = cfg.train
    return {
        # load_universal: a checkpoint of another world size (workers/trainer/reshard.py)
        "checkpoint": {"load_universal": load_universal},
        "train_micro_batch_size_per_gpu": 1,  # one packed batch per micro-step; its size is set by data.*
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": t.precision == "bf16"},
        # torch's AdamW (no C++ op build on machines without a prebuilt FusedAdam), in its fused kernel (CPU and
        # CUDA): one pass per tensor instead of about a dozen; on the CPU step bench's v4 draft 30 -> 9 ms per step
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay,
                                                  "torch_adam": True, "fused": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.max_steps, "warmup_num_steps": max(t.warmup_steps, 1),
            "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr_ratio, "warmup_type": "linear"}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def deepspeed_engine(module: DraftWithLoss, cfg: RunConfig, load_universal: bool = False) -> Any:
    """`module` under DeepSpeed with the run's optimizer groups, ZeRO stage and schedule (torch.distributed must be
    initialised). Under ZeRO-3 the sequential head's W2 is read by DraftWithLoss.forward, outside any forward of
    the head itself, so it is registered as the module's external parameter: gathered for the loss's forward
    and, through the hooks on DraftWithLoss's output tensors, again for its backward."""
    import deepspeed

    w2 = module.draft.head_w2()
    if cfg.train.zero_stage == 3 and w2 is not None:
        deepspeed.zero.register_external_parameter(module, w2)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=param_groups(module, cfg),
                                      config=deepspeed_config(cfg, load_universal),
                                      dist_init_required=not dist.is_initialized())
    return engine


class Resumed(NamedTuple):
    engine: Any
    start_step: int
    ledger: Ledger
    universal: Path | None  # the universal copy it was loaded through (another world size), or None


def resumed_engine(module: DraftWithLoss, cfg: RunConfig, ckpts: CheckpointManager, resume_from: Path | None,
                   rank: int, world: int, log: Any, samples_digest: str = "") -> Resumed:
    """`module` under DeepSpeed, restored from checkpoint `resume_from` (None: a fresh start), with its step and
    sample ledger. A checkpoint of another world size goes through DeepSpeed's universal checkpoint
    (workers/trainer/reshard.py)."""
    universal = universal_source(resume_from, cfg, rank, world)  # None unless the world size changed
    engine = deepspeed_engine(module, cfg, load_universal=universal is not None)
    if universal is None:
        start_step, ledger = resume(engine, ckpts, resume_from, rank, log, samples_digest)
    else:
        start_step = load_universal(engine, universal, resume_from, rank, log)
        ledger = resume_ledger(resume_from, rank, samples_digest)
    return Resumed(engine, start_step, ledger, universal)


class FeatureServiceBatches:
    """This rank's micro-batches from the FeatureService: `start` issues the `get` calls (the service then has
    the target produce them, within its in-flight bound), `take` resolves the refs and packs.

    A batch whose producing worker died is re-run by Ray on the restarted worker, so `take` just waits (at most
    `target.batch_timeout_s`, then one clear error instead of a hang). A reference lost with its owner (the
    service restarted), or with a target group that lost a member (workers/target/group.py: the group restarts
    whole and cannot take its old calls along), is asked for again: the service's `get` is idempotent."""

    RETRIES = 3

    def __init__(self, service: Any, cfg: RunConfig, rank: int, world: int, num_samples: int,
                 device: torch.device) -> None:
        self.service, self.cfg, self.rank, self.world, self.num_samples = service, cfg, rank, world, num_samples
        self.dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        self.device = device
        self._calls: dict[int, list[tuple[int, ray.ObjectRef]]] = {}

    def start(self, step: int) -> None:
        ga = self.cfg.train.grad_accum
        indices = [batch_index_for(step, m, self.rank, ga, self.world) for m in range(ga)]
        self._calls[step] = [(b, self.service.get.remote(b)) for b in indices]

    def _fetch(self, b: int, call: ray.ObjectRef) -> Any:
        timeout = self.cfg.target.batch_timeout_s
        for attempt in range(self.RETRIES + 1):
            try:
                (ref,) = ray.get(call, timeout=timeout)
                return ray.get(ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"feature batch {b} not ready after {timeout:.0f} s (target.batch_timeout_s): "
                                   "no target worker produced it; see the target workers' logs") from None
            except (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError) as e:
                if attempt == self.RETRIES:
                    raise
                get_logger("dspark.trainer", self.rank).warning(
                    "feature batch %d lost (%s); asking the feature service again", b, type(e).__name__)
                call = self.service.get.remote(b)
        raise AssertionError("unreachable")

    def take(self, step: int) -> list[MicroBatch]:
        return [pack_micro_batch(self._fetch(b, call), b, self.cfg, self.num_samples, self.dtype, self.device)
                for b, call in self._calls.pop(step)]

    def close(self) -> None:
        self._calls.clear()


# Errors a restart of the trainer group would only repeat (a non-finite loss, a bad checkpoint, a batch that never
# comes, a bad value): reported once instead of being retried cluster.max_failures times. Anything else (a peer
# rank died, a collective broke, an actor was lost) is left to Ray Train's restart.
FATAL_ERRORS = (FloatingPointError, ValueError, TimeoutError, CheckpointError)


def train_loop(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: one call per trainer rank. Ray Train retries any failure of the group; a failure in
    FATAL_ERRORS is recorded in RunControl first, so the retried group returns at once and the driver reports it."""
    control = loop_config["control"]
    if ray.get(control.fatal_error.remote()) is not None:
        return
    try:
        _train(loop_config)
    except FATAL_ERRORS as e:
        ray.get(control.record_fatal.remote(f"{type(e).__name__}: {e}"))
        raise


def _train(loop_config: dict[str, Any]) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = get_logger("dspark.trainer", rank)
    cfg = config_from_dict(loop_config["config"])
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.use_gpu else torch.device("cpu")

    embed_VD, lm_head_VD = ray.get(loop_config["weights_ref"])
    draft = build_draft(cfg.draft, embed_VD, lm_head_VD)
    setup_moe_balance(draft)
    if cfg.train.compile:
        compile_draft(draft)
    ckpts = CheckpointManager(cfg.checkpoint.run_dir, cfg.checkpoint.keep_last)
    # Every (re)start finds its own resume point: after a trainer failure Ray Train runs this function again,
    # and the checkpoint to continue from is the newest one committed so far, not the one the job started from.
    # Rank 0 decides (verifying it) and tells the others, so that all ranks load the same one.
    (latest,) = all_gather(str(ckpts.latest() or "") if rank == 0 else None)[:1]
    resume_from = Path(latest) if latest else None
    engine, start_step, ledger, _ = resumed_engine(DraftWithLoss(draft, cfg.loss), cfg, ckpts, resume_from, rank,
                                                   world, log, loop_config["samples_digest"])

    sink = NullSink()
    if rank == 0:
        sinks = [JsonlSink(os.path.join(cfg.checkpoint.run_dir, "metrics.jsonl"))]
        if cfg.train.tensorboard:
            sinks.append(TensorBoardSink(os.path.join(cfg.checkpoint.run_dir, "tensorboard")))
        sink = MultiSink(*sinks)
    batches = FeatureServiceBatches(loop_config["service"], cfg, rank, world, loop_config["num_samples"], device)
    control = loop_config["control"]
    try:
        # SIGTERM only: Ray delivers task cancellation to its workers as SIGINT
        with stop_on_signal(lambda name: control.request_stop.remote(f"{name} on a trainer"),
                            signals=(signal.SIGTERM,)) as local_stop:
            result = fit(engine, batches, ckpts, sink, cfg, rank, world, start_step, log, ledger=ledger,
                         poll=StopPoller(control, local_stop), num_samples=loop_config["num_samples"])
        if cfg.checkpoint.export and result.stopped_at is None:
            _export(engine, cfg, rank)
    finally:
        sink.close()


def _export(engine: Any, cfg: RunConfig, rank: int) -> None:
    import deepspeed

    draft: nn.Module = engine.module.draft
    with deepspeed.zero.GatheredParameters(list(draft.parameters()), enabled=cfg.train.zero_stage == 3):
        if rank == 0:
            state = {k: v.float() for k, v in draft.state_dict().items()}
            out = export_draft(state, export_meta(cfg), os.path.join(cfg.checkpoint.run_dir, "export"))
            get_logger("dspark.trainer", rank).info("exported the draft to %s", out)
    barrier()
