"""The one training loop, shared by the Ray Train + DeepSpeed trainers (workers/trainer.py) and the single-process
trainer (workers/single_process.py). It never asks how it is deployed; what differs comes in as parameters:

- `batches`   a `StepBatches`: this rank's packed micro-batches of a step. `start(step)` begins fetching them
              without blocking, `take(step)` waits for them. The loop starts step s+1 before it trains step s,
              so the next step's features are fetched while this one computes (Ray: the FeatureService calls are
              in flight; single process: a one-deep background thread runs the target).
- `engine`    DeepSpeed's engine interface (`engine(batch)`, `backward`, `step`, `get_lr`, `save_checkpoint`,
              `load_checkpoint`): a DeepSpeed engine, or workers/single_process.TorchEngine.
- `checkpointer` a workers/checkpoint.CheckpointManager; `sink` a pipeline/metrics sink (NullSink off rank 0).

Per step: fetch, `optimizer_step` (workers/train_step.py: loss scaling and the step itself), the all-reduced
metrics, one log line, the sink, the progress bar, and a checkpoint every `checkpoint.every_steps` and at the end.
Collectives go through torch.distributed when it is initialised and are no-ops otherwise (one process).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from draft_model.batch import BlockBatch
from pipeline.config import RunConfig
from pipeline.metrics import MetricsSink
from pipeline.order import batch_index_for
from pipeline.packing import PackStats
from workers.checkpoint import CheckpointManager
from workers.train_step import all_reduce_sum, format_step, optimizer_step, step_metrics

MicroBatch = tuple[BlockBatch, PackStats, int]  # (packed batch on the device, its pack stats, wire bytes)


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


def resume(engine: Any, checkpointer: CheckpointManager, path: Path | None, rank: int,
           log: logging.Logger) -> int:
    """Restore the engine and this rank's RNG from checkpoint `path` (None: a fresh start); returns its step."""
    if path is None:
        return 0
    meta = checkpointer.load(engine, Path(path), rank)
    log.info("resumed from %s at step %d", path, int(meta["step"]))
    return int(meta["step"])


def fit(engine: Any, batches: StepBatches, checkpointer: CheckpointManager, sink: MetricsSink, cfg: RunConfig,
        rank: int, world: int, start_step: int, log: logging.Logger, bar: Any = None) -> dict[str, float] | None:
    """Train from `start_step` to `train.max_steps`; returns the last step's metrics (None if none ran)."""
    t = cfg.train
    metrics = None
    t_start = time.time()
    try:
        if start_step < t.max_steps:
            batches.start(start_step)
        for step in range(start_step, t.max_steps):
            t0 = time.time()
            micro = batches.take(step)
            if step + 1 < t.max_steps:
                batches.start(step + 1)  # overlaps the next step's fetch with this step's compute
            t_data = time.time() - t0

            acc, global_w = optimizer_step(engine, micro, cfg.loss.decay_lambda, world)
            if micro and micro[0][0].input_ids_T.is_cuda:
                torch.cuda.synchronize()  # so that dt is the step's time, not the time to queue its kernels
            metrics = step_metrics(all_reduce_sum(list(acc.values())), global_w, cfg, world, time.time() - t0,
                                   t_data, engine.get_lr()[0], step + 1)
            if rank == 0:
                sink.log(step + 1, metrics)
                if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                    eta = (time.time() - t_start) / (step + 1 - start_step) * (t.max_steps - step - 1)
                    log.info("%s", format_step(step + 1, t.max_steps, metrics, eta))
                if bar is not None:
                    bar.update(1)
            if (step + 1) % cfg.checkpoint.every_steps == 0 or step + 1 == t.max_steps:
                meta = {"data_position": {"next_batch_index": batch_index_for(step + 1, 0, 0, t.grad_accum, world),
                                          "world_size": world, "grad_accum": t.grad_accum},
                        "config": cfg.to_dict(), "metrics": metrics, "engine": type(engine).__name__}
                path = checkpointer.save(engine, step + 1, meta, rank, barrier)
                if rank == 0:
                    log.info("checkpoint %s", path)
    finally:
        batches.close()
    return metrics
