"""Draft trainer workers: the Ray Train (TorchTrainer) entry point that runs a DeepSpeed engine on packed blocks.

Rank r of R builds the draft, its DeepSpeed engine (workers/trainer/engines.py) and a `FeatureServiceBatches`
source, then runs the shared loop (workers/trainer/loop.py): per optimizer step it fetches its `grad_accum` feature
batches from the FeatureService (batch indices from pipeline/order.py) and packs them into BlockBatches on the device
on a background thread while the previous step computes (workers/trainer/prefetch.py), then runs `optimizer_step`
(workers/trainer/step.py): one ZeRO step. The LM head is applied here, locally, at the block positions only (inside
the chunked loss).
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from torch import nn

from draft_model.registry import build_draft
from pipeline.config import RunConfig, config_from_dict
from pipeline.export import export_draft, export_meta
from pipeline.metrics import JsonlSink, MultiSink, NullSink, TensorBoardSink, get_logger
from pipeline.order import batch_index_for
from workers.lease import LeaseLost
from workers.oom import OutOfMemory
from workers.preemption import stop_on_signal
from workers.run_control import StopPoller
from workers.trainer.checkpoint import CheckpointError, CheckpointManager
from workers.trainer.engines import resumed_engine
from workers.trainer.loop import MicroBatch, all_gather, barrier, fit
from workers.trainer.precision import describe as describe_dtype
from workers.trainer.precision import frozen_dtype, loss_matmul_dtype
from workers.trainer.prefetch import OneStepAhead
from workers.trainer.reshard import elastic_world
from workers.trainer.serving_export import export_for_engines
from workers.trainer.step import DraftWithLoss, pack_micro_batch, prepare_draft


class FeatureServiceBatches:
    """This rank's micro-batches from the FeatureService: `start` issues the `get` calls (the service then has
    the target produce them, within its in-flight bound) and hands the step to a background thread
    (workers/trainer/prefetch.py) that pulls the objects, unpickles, packs and moves them to the device while the
    previous step computes; `take` returns what that thread made.

    A batch whose producing worker died is re-run by Ray on the restarted worker, so the fetch just waits (at most
    `target.batch_timeout_s`, then one clear error instead of a hang). A reference lost with its owner (the
    service restarted), or with a target group that lost a member (workers/frozen_target/group.py: the group restarts
    whole and cannot take its old calls along), is asked for again: the service's `get` is idempotent."""

    RETRIES = 3

    def __init__(self, service: Any, cfg: RunConfig, rank: int, world: int, num_samples: int,
                 device: torch.device) -> None:
        self.service, self.cfg, self.rank, self.world, self.num_samples = service, cfg, rank, world, num_samples
        self.dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        self.device = device
        self._calls: dict[int, list[tuple[int, ray.ObjectRef]]] = {}
        self._ahead = OneStepAhead(self._make, device, "features")

    def start(self, step: int) -> None:
        ga = self.cfg.train.grad_accum
        indices = [batch_index_for(step, m, self.rank, ga, self.world) for m in range(ga)]
        self._calls[step] = [(b, self.service.get.remote(b)) for b in indices]
        self._ahead.start(step)

    def _fetch(self, b: int, call: ray.ObjectRef) -> Any:
        timeout = self.cfg.target.batch_timeout_s
        for attempt in range(self.RETRIES + 1):
            try:
                (ref,) = ray.get(call, timeout=timeout)
                # pull the object to this node first (a cross-node transfer), then deserialize it
                ready, _ = ray.wait([ref], timeout=timeout, fetch_local=True)
                if not ready:
                    raise ray.exceptions.GetTimeoutError(f"feature batch {b}")
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

    def _make(self, step: int) -> list[MicroBatch]:
        return [pack_micro_batch(self._fetch(b, call), b, self.cfg, self.num_samples, self.dtype, self.device)
                for b, call in self._calls.pop(step)]

    def take(self, step: int) -> list[MicroBatch]:
        return self._ahead.take(step)

    def close(self) -> None:
        self._ahead.close()
        self._calls.clear()


# Errors a restart of the trainer group would only repeat (a non-finite loss, a bad checkpoint, a batch that never
# comes, a bad value): reported once instead of being retried cluster.max_failures times. Anything else (a peer
# rank died, a collective broke, an actor was lost) is left to Ray Train's restart.
# LeaseLost: the driver is gone or another took the run dir over; a restarted group would find the same. A
# CheckpointError includes a save that hit a full disk, a quota, a read-only file system or a permission error.
# OutOfMemory (workers/oom.py): the same batch runs out of GPU memory again on a rebuilt group, and so does a target
# group's forward (raised to the trainer through its feature batch).
FATAL_ERRORS = (FloatingPointError, ValueError, TimeoutError, CheckpointError, LeaseLost, OutOfMemory)


def train_loop(loop_config: dict[str, Any]) -> None:
    """Ray Train entry point: one call per trainer rank. Ray Train retries any failure of the group; a failure in
    FATAL_ERRORS is not a failure to it: the rank records it in RunControl, leaves the process group (so a peer
    blocked in a collective fails at once instead of at the group's timeout) and returns; a peer whose step broke
    on that finds the record and returns too. The group ends without a retry or a worker traceback, and the driver
    reports the one line (workers/driver.py). Any other failure is raised for Ray Train to retry; a retried group
    that finds a fatal error recorded returns at once."""
    control = loop_config["control"]
    if ray.get(control.fatal_error.remote()) is not None:
        return
    try:
        _train(loop_config)
    except Exception as e:
        # a write outside a save (metrics, TensorBoard) that hit a full disk, a quota, a read-only file system or a
        # permission error is fatal too, as a save's is (workers/trainer/checkpoint.StorageError)
        fatal = e if isinstance(e, FATAL_ERRORS) else CheckpointManager(
            loop_config["config"]["checkpoint"]["run_dir"]).write_failure(e)
        if fatal is not None:
            if not _recorded(control, _one_line(fatal)):
                raise  # RunControl died with the driver: nobody is left to report it
            _leave_process_group()
            return
        try:
            peer_fatal = ray.get(control.fatal_error.remote())
        except ray.exceptions.RayActorError:
            peer_fatal = None
        if peer_fatal is None:
            raise
        _leave_process_group()  # a consequence of a peer's fatal error (the peer left the collective): not retried


def _one_line(e: BaseException) -> str:
    """'Type: message' of a fatal error; one raised on a target worker arrives wrapped in a RayTaskError (its str
    a traceback): its root cause's line."""
    cause = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
    e = cause if isinstance(cause, BaseException) else e
    return f"{type(e).__name__}: {e}"


def _recorded(control: Any, message: str) -> bool:
    try:
        ray.get(control.record_fatal.remote(message))
        return True
    except ray.exceptions.RayActorError:
        return False


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already broken by the peer that left first: nothing left to close
            pass


def _train(loop_config: dict[str, Any]) -> None:
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log = get_logger("dspark.trainer", rank)
    cfg = config_from_dict(loop_config["config"])
    if world != cfg.cluster.num_trainers:  # an elastic group (cluster.min_trainers) on the trainers Ray could place
        launched = cfg.cluster.num_trainers
        cfg = elastic_world(cfg, world)
        if rank == 0:
            log.warning("elastic: training on %d of %d trainers (grad_accum %d, global batch %d unchanged)", world,
                        launched, cfg.train.grad_accum, cfg.train.grad_accum * world)
    torch.manual_seed(cfg.train.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.cluster.use_gpu else torch.device("cpu")

    fence = loop_config.get("fence")  # workers/lease.Fence: commits only while the driver's lease is current
    ckpts = CheckpointManager(cfg.checkpoint.run_dir, cfg.checkpoint.keep_last,
                              fence=fence.check_commit if fence is not None else None)
    # Every (re)start finds its own resume point: after a trainer failure Ray Train runs this function again,
    # and the checkpoint to continue from is the newest one committed so far, not the one the job started from.
    # Rank 0 decides (verifying it) and tells the others, so that all ranks load the same one.
    (latest,) = all_gather(str(ckpts.latest() or "") if rank == 0 else None)[:1]
    resume_from = Path(latest) if latest else None
    # rank 0's device decides an `auto` loss dtype for every rank (one numerics per run), or its checkpoint does
    (matmul,) = all_gather(loss_matmul_dtype(cfg.loss.matmul_dtype, device, resume_from) if rank == 0 else None)[:1]
    cfg.loss = replace(cfg.loss, matmul_dtype=matmul[0])
    if rank == 0:
        log.info("%s", describe_dtype(*matmul))
    embed_VD, lm_head_VD = ray.get(loop_config["weights_ref"])
    draft = prepare_draft(build_draft(cfg.draft, embed_VD, lm_head_VD, frozen_dtype=frozen_dtype(cfg)), cfg)
    engine, start_step, ledger, _ = resumed_engine(DraftWithLoss(draft, cfg.loss), cfg, ckpts, resume_from, rank,
                                                   world, log, loop_config["samples_digest"])

    sink = NullSink()
    if rank == 0:
        # the rows and events of steps past start_step came from a run that crashed after its last checkpoint:
        # they go, so the record holds one curve (pipeline/metrics.drop_rows_after)
        sinks = [JsonlSink(os.path.join(cfg.checkpoint.run_dir, "metrics.jsonl"), resume_step=start_step)]
        if cfg.train.tensorboard:
            sinks.append(TensorBoardSink(os.path.join(cfg.checkpoint.run_dir, "tensorboard"), resume_step=start_step))
        sink = MultiSink(*sinks)
    batches = FeatureServiceBatches(loop_config["service"], cfg, rank, world, loop_config["num_samples"], device)
    control = loop_config["control"]
    try:
        # SIGTERM only: Ray delivers task cancellation to its workers as SIGINT
        with stop_on_signal(lambda name: control.request_stop.remote(f"{name} on a trainer"),
                            signals=(signal.SIGTERM,)) as local_stop:
            result = fit(engine, batches, ckpts, sink, cfg, rank, world, start_step, log, ledger=ledger,
                         poll=StopPoller(control, local_stop, fence=fence), num_samples=loop_config["num_samples"])
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
            log = get_logger("dspark.trainer", rank)
            log.info("exported the draft to %s", out)
            export_for_engines(out, cfg, log)
    barrier()
