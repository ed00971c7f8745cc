"""The one training loop, shared by the Ray Train + DeepSpeed trainers (workers/trainer/ray_trainer.py) and the
single-process trainer (workers/trainer/single_process.py). It never asks how it is deployed; what differs comes in as
parameters:

- `batches`   a `StepBatches`: this rank's packed micro-batches of a step. `start(step)` begins fetching them
              without blocking, `take(step)` waits for them. The loop starts step s+1 before it trains step s,
              so the next step's features are fetched while this one computes: both sources hand the step to a
              one-deep background thread (workers/trainer/prefetch.py) that fetches (Ray) or encodes (single
              process), packs, copies to the device and decodes.
- `engine`    DeepSpeed's engine interface (`engine(batch)`, `backward`, `step`, `get_lr`, `save_checkpoint`,
              `load_checkpoint`): a DeepSpeed engine, or workers/trainer/engines.TorchEngine.
- `checkpointer` a workers/trainer/checkpoint.CheckpointManager; `sink` a pipeline/metrics sink (NullSink off rank 0).
- `ledger`    a workers/trainer/ledger.Ledger (from `resume`): the samples each committed step trained.
- `poll`      called once per step on every rank: a workers/preemption.Notice. If any rank says stop, every
              rank checkpoints after that step and `fit` returns early; if any says checkpoint, all checkpoint
              after that step and go on (a node of the group is being drained); if any says its driver is gone
              (workers/lease.py), every rank raises LeaseLost at once, writing nothing more.

Per step: fetch, `optimizer_step` (workers/trainer/step.py: loss scaling and the step itself), the all-reduced
metrics, one log line, the sink, and a checkpoint (with the sample ledger) every
`checkpoint.every_steps`, at the end, and when asked to stop. Collectives go through torch.distributed when it is
initialised and are no-ops otherwise (one process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from pipeline.config import RunConfig
from pipeline.metrics import MetricsSink
from pipeline.order import batch_index_for
from workers.lease import LeaseLost
from workers.oom import out_of_memory_is_fatal, trainer_fetch_oom, trainer_step_oom
from workers.preemption import Notice
from workers.trainer.checkpoint import CheckpointManager
from workers.trainer.ledger import LEDGER_FILE, Ledger, read_ledger, write_ledger
from workers.trainer.step import MicroBatch, all_reduce_sum, check_features, format_step, optimizer_step, step_metrics

__all__ = ["FitResult", "MicroBatch", "StepBatches", "barrier", "fit", "resume", "resume_ledger"]


class StepBatches(Protocol):
    def start(self, step: int) -> None:
        """Begin fetching this rank's micro-batches of `step` (returns at once; called once per step, in order)."""

    def take(self, step: int) -> list[MicroBatch]:
        """This rank's `grad_accum` micro-batches of `step`, in micro-step order (waits for `start`'s fetch)."""

    def close(self) -> None:
        """Drop anything still in flight."""


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def resume_ledger(path: Path | None, rank: int, samples_digest: str) -> Ledger:
    """The sample ledger to continue from checkpoint `path`: rank 0 holds the committed history, the others
    only add to it."""
    rows: list = []
    if path is not None and rank == 0 and (Path(path) / LEDGER_FILE).is_file():
        rows, saved_digest = read_ledger(Path(path) / LEDGER_FILE)
        if samples_digest and saved_digest and saved_digest != samples_digest:
            raise ValueError(f"{path}: its ledger names samples of another samples file (sha256 {saved_digest[:12]}"
                             f" there, {samples_digest[:12]} now): the training data changed under the run")
    return Ledger(rows, samples_digest)


def resume(engine: Any, checkpointer: CheckpointManager, path: Path | None, rank: int, log: logging.Logger,
           samples_digest: str = "") -> tuple[int, Ledger]:
    """Restore the engine and this rank's RNG from checkpoint `path` (None: a fresh start); returns its step and
    the sample ledger to continue."""
    if path is None:
        return 0, Ledger(samples_digest=samples_digest)
    meta = checkpointer.load(engine, Path(path), rank)
    log.info("resumed from %s at step %d", path, int(meta["step"]))
    return int(meta["step"]), resume_ledger(path, rank, samples_digest)


def save_checkpoint(engine: Any, checkpointer: CheckpointManager, ledger: Ledger, cfg: RunConfig, step: int,
                    rank: int, world: int, metrics: dict[str, float], num_samples: int) -> Path:
    """Collective: checkpoint after `step` with the data position and the sample ledger of steps 1..step (every
    rank's notes gathered on rank 0 and committed inside the checkpoint)."""
    t = cfg.train
    meta = {"data_position": {"next_batch_index": batch_index_for(step, 0, 0, t.grad_accum, world),
                              "world_size": world, "grad_accum": t.grad_accum, "num_samples": num_samples,
                              "samples_digest": ledger.samples_digest},
            "config": cfg.to_dict(), "metrics": metrics, "engine": type(engine).__name__}
    gathered = all_gather(ledger.pending)
    if rank != 0:
        ledger.drop_pending()
        return checkpointer.save(engine, step, meta, rank, barrier)
    rows = ledger.commit(gathered)
    return checkpointer.save(engine, step, meta, rank, barrier,
                             extra_files=lambda tmp: write_ledger(rows, tmp / LEDGER_FILE, ledger.samples_digest))


@dataclass
class FitResult:
    metrics: dict[str, float] | None  # the last step's (None if no step ran)
    stopped_at: int | None = None  # the step it checkpointed and stopped at when asked to stop early


def fit(engine: Any, batches: StepBatches, checkpointer: CheckpointManager, sink: MetricsSink, cfg: RunConfig,
        rank: int, world: int, start_step: int, log: logging.Logger, ledger: Ledger | None = None,
        poll: Callable[[], Notice] | None = None, num_samples: int = 0) -> FitResult:
    """Train from `start_step` to `train.max_steps`, or until `poll` says stop on any rank."""
    t = cfg.train
    metrics = None
    ledger = ledger if ledger is not None else Ledger()
    t_start = time.time()
    try:
        if start_step < t.max_steps:
            batches.start(start_step)
        for step in range(start_step, t.max_steps):
            t0 = time.time()
            # the prefetch thread's device copies and decode raise their OOM here
            with out_of_memory_is_fatal(trainer_fetch_oom, rank, step + 1, cfg):
                micro = batches.take(step)
            if step + 1 < t.max_steps:
                batches.start(step + 1)  # overlaps the next step's fetch with this step's compute
            t_data = time.time() - t0

            with out_of_memory_is_fatal(trainer_step_oom, rank, step + 1, micro, cfg):
                rank_sums, global_w = optimizer_step(engine, micro, cfg.loss.decay_lambda, world)
            for mb in micro:
                ledger.record(step + 1, mb.batch_index, rank, world, mb.sample_ids)
            # the ranks' votes ride on the metrics' all-reduce, so all of them act after the same step
            notice = poll() if poll is not None else Notice()
            *totals, stop_votes, ckpt_votes, gone_votes = all_reduce_sum(
                [*rank_sums.values(), float(notice.stop), float(notice.checkpoint), float(bool(notice.gone))])
            if gone_votes > 0:  # the run dir is not this driver's any more: no metrics, no checkpoint
                raise LeaseLost(f"stopping at step {step + 1}, before its checkpoint and metrics: "
                                f"{notice.gone or 'another trainer rank found its driver gone'}")
            check_features(dict(zip(rank_sums, totals))["bad_features"], micro, step + 1)  # on every rank
            # dt ends after a host read of the step's results (optimizer_step's sums, this all-reduce): the kernels
            # are done by then, so it is the step's time with no synchronize of its own
            metrics = step_metrics(totals, global_w, cfg, world, time.time() - t0, t_data, engine.get_lr()[0],
                                   step + 1)
            if rank == 0:
                sink.log(step + 1, metrics)
                if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                    eta = (time.time() - t_start) / (step + 1 - start_step) * (t.max_steps - step - 1)
                    log.info("%s", format_step(step + 1, t.max_steps, metrics, eta))
            stop = stop_votes > 0 and step + 1 < t.max_steps
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == t.max_steps or stop or ckpt_votes > 0:
                path = save_checkpoint(engine, checkpointer, ledger, cfg, step + 1, rank, world, metrics,
                                       num_samples)
                if rank == 0:
                    log.info("checkpoint %s", path)
            if stop:
                if rank == 0:
                    log.info("stopping at step %d on request (preemption notice); checkpoint saved, re-run the same "
                             "command to resume", step + 1)
                return FitResult(metrics, stopped_at=step + 1)
    finally:
        batches.close()
    return FitResult(metrics)
