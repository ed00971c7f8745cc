"""Draft training in one process on one device, without Ray or DeepSpeed.

The pieces are the distributed pipeline's own: `TargetWorker.encode` makes the features (rounded through the wire
dtype, as on the object store), pipeline/order.py fixes the batch order, pipeline/packing.py packs the blocks, and
the shared loop (workers/trainer/loop.py) runs the steps. Only the engine and the batch source differ:
`TorchEngine` (workers/trainer/engines.py) updates the parameters exactly as the DeepSpeed engine does;
`LocalBatches` runs the target for the next step on a background thread while this one trains.

Use it on one GPU or CPU where Ray and DeepSpeed are not installed (bench/drafters.py on a lent accelerator) and
for debugging. It writes the same resumable checkpoints as the Ray trainers (workers/trainer/checkpoint.py layout, with
TorchEngine's state under ds/), and running it again on the same run dir resumes from `latest`. The draft trains in
fp32 (TF32 matmuls on CUDA); the target runs in target.dtype.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from draft_model.registry import build_draft
from pipeline.config import RunConfig, save_config
from pipeline.export import export_draft, export_meta
from pipeline.metrics import JsonlSink
from pipeline.order import batch_index_for, batch_sample_ids
from workers.frozen_target.feature_cache import has_all, open_feature_cache, read_batch
from workers.lease import Fence
from workers.preemption import Notice, StoppedEarly, stop_on_signal
from workers.trainer.checkpoint import CheckpointManager
from workers.trainer.engines import TorchEngine
from workers.trainer.loop import MicroBatch, fit, resume
from workers.trainer.precision import describe as describe_dtype
from workers.trainer.precision import loss_matmul_dtype
from workers.trainer.prefetch import OneStepAhead
from workers.trainer.serving_export import export_for_engines
from workers.trainer.step import DraftWithLoss, pack_micro_batch, prepare_draft


class LocalBatches:
    """Micro-batches from an in-process TargetWorker. `start(step)` hands the step to one background thread
    (workers/trainer/prefetch.py), so the target encodes, and the packer packs and moves, step s+1 while step s
    trains; steps are made one at a time, in order, so the features are the ones a sequential run makes."""

    def __init__(self, worker: Any, samples: list, cfg: RunConfig, device: torch.device,
                 cache: str | None = None) -> None:
        self.worker, self.samples, self.cfg, self.device, self.cache = worker, samples, cfg, device, cache
        self._ahead = OneStepAhead(self._make, device, "encode")

    def _make(self, step: int) -> list[MicroBatch]:
        cfg, out = self.cfg, []
        for m in range(cfg.train.grad_accum):
            b = batch_index_for(step, m, 0, cfg.train.grad_accum, 1)
            ids = batch_sample_ids(b, len(self.samples), cfg.data.samples_per_batch, cfg.data.seed)
            batch = [self.samples[i] for i in ids]
            fb = (read_batch(self.cache, b, batch) if self.cache and has_all(self.cache, ids) else
                  self.worker.encode(b, batch, self.cache))
            out.append(pack_micro_batch(fb, b, cfg, len(self.samples), torch.float32, self.device))
        return out

    def start(self, step: int) -> None:
        self._ahead.start(step)

    def take(self, step: int) -> list[MicroBatch]:
        return self._ahead.take(step)

    def close(self) -> None:
        self._ahead.close()


def train_single_process(cfg: RunConfig, log: logging.Logger, device: str = "auto",
                         resume_from: Path | None = None, fence: Fence | None = None) -> Path:
    """Train `cfg` to the end in this process, from checkpoint `resume_from` if given; returns the export
    directory. `fence`: the run dir's lease this process holds (workers/lease.py), checked every step and before
    every commit (a process paused past the lease's ttl, then taken over, writes nothing more)."""
    from pipeline.errors import InputError
    from pipeline.resume import check_resume, check_samples
    from pipeline.sample_store import samples_digest as digest_samples
    from workers.frozen_target.worker import TargetWorker
    from workers.inputs import resolve_inputs

    on_gpu = device != "cpu" and (device != "auto" or torch.cuda.is_available())
    if cfg.train.precision == "bf16" and not on_gpu:
        raise InputError("train.precision=bf16 (autocast) on a CPU is many times slower than fp32 on CPUs without "
                         "AMX (docs/design-notes.md): set train.precision=fp32, or run on a GPU")
    if cfg.target.tp_size > 1:
        raise InputError(f"the single-process trainer holds the whole target in this process: target.tp_size must "
                         f"be 1, got {cfg.target.tp_size} (target groups need the Ray pipeline)")
    meta = json.loads((Path(resume_from) / "meta.json").read_text()) if resume_from is not None else None
    if meta is not None:
        check_resume(cfg, meta)
    run_dir = Path(cfg.checkpoint.run_dir)
    target_path, samples = resolve_inputs(cfg, log)
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    worker = TargetWorker(target_path, list(cfg.draft.target_layers), cfg.target.dtype, cfg.target.wire_dtype,
                          device=str(dev), max_tokens_per_forward=cfg.target.max_tokens_per_forward,
                          max_seq_len=cfg.data.max_len)
    vocab, hidden, layers = worker.info()
    try:
        cfg.draft = cfg.draft.resolved_for_target(vocab, hidden, layers)
    except ValueError as e:
        raise InputError(str(e)) from e
    dtype, why = loss_matmul_dtype(cfg.loss.matmul_dtype, dev, resume_from)
    cfg.loss = replace(cfg.loss, matmul_dtype=dtype)  # saved resolved in every checkpoint: a resume keeps it
    log.info("%s", describe_dtype(dtype, why))
    torch.manual_seed(cfg.train.seed)
    embed_VD, lm_head_VD = worker.embedding_weights()
    module = DraftWithLoss(prepare_draft(build_draft(cfg.draft, embed_VD, lm_head_VD), cfg), cfg.loss).to(dev)
    engine = TorchEngine(module, cfg)
    ckpts = CheckpointManager(run_dir, cfg.checkpoint.keep_last,
                              fence=fence.check_commit if fence is not None else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_digest = digest_samples(samples)  # what the ledger's sample ids refer to (no samples file: in memory)
    if meta is not None:
        check_samples(meta, samples_digest)
    cache = open_feature_cache(cfg, samples_digest, target_path, log)
    start_step, ledger = resume(engine, ckpts, resume_from, 0, log, samples_digest)

    save_config(cfg, run_dir / "config.yaml")
    sink = JsonlSink(str(run_dir / "metrics.jsonl"), resume_step=start_step)  # rows past the checkpoint go
    log.info("single-process training of a %s draft (%d layers, head %s, gamma %d) on %s for %d steps; %d samples;"
             " %s", cfg.draft.arch, cfg.draft.num_layers, cfg.draft.head, cfg.draft.block_size, dev,
             cfg.train.max_steps, len(samples), f"resuming from {resume_from}" if resume_from else "fresh start")
    t_start = time.time()
    try:
        with stop_on_signal(lambda _name: None) as stop:
            batches = LocalBatches(worker, samples, cfg, dev, cache)
            result = fit(engine, batches, ckpts, sink, cfg, 0, 1, start_step, log, ledger=ledger,
                         poll=lambda: Notice(stop=stop.is_set(), gone=(fence.check() if fence else None) or ""),
                         num_samples=len(samples))
    finally:
        sink.close()
    if result.stopped_at is not None:
        raise StoppedEarly(result.stopped_at, cfg.train.max_steps)
    state = {k: v.detach().float().cpu() for k, v in module.draft.state_dict().items()}
    out = export_draft(state, export_meta(cfg), run_dir / "export")
    log.info("exported the draft to %s (%.0f s)", out, time.time() - t_start)
    export_for_engines(out, cfg, log)
    return Path(out)
