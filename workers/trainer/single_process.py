"""Draft training in one process on one device, without Ray or DeepSpeed.

The pieces are the distributed pipeline's own: `TargetWorker.encode` makes the features (rounded through the wire
dtype, as on the object store), pipeline/order.py fixes the batch order, pipeline/packing.py packs the blocks, and
the shared loop (workers/trainer/loop.py) runs the steps. Only the engine and the batch source differ: `TorchEngine`
is torch's AdamW, gradient-norm clipping and a LambdaLR that follows DeepSpeed's WarmupCosineLR step for step
(with the same config it updates the parameters exactly as the DeepSpeed engine does: tests/test_trainer_step.py);
`LocalBatches` runs the target for the next step on a background thread while this one trains.

Use it on one GPU or CPU where Ray and DeepSpeed are not installed (bench/drafters.py on a lent accelerator) and
for debugging. It writes the same resumable checkpoints as the Ray trainers (workers/trainer/checkpoint.py layout, with
TorchEngine's state under ds/), and running it again on the same run dir resumes from `latest`. The draft trains in
fp32 (TF32 matmuls on CUDA); the target runs in target.dtype.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draft_model.batch import BlockBatch
from draft_model.registry import build_draft
from pipeline.config import RunConfig, save_config
from pipeline.export import export_draft, export_meta
from pipeline.metrics import JsonlSink
from pipeline.order import batch_index_for, batch_sample_ids
from workers.preemption import Notice, StoppedEarly, stop_on_signal
from workers.trainer.checkpoint import CheckpointManager
from workers.trainer.loop import MicroBatch, fit, resume
from workers.trainer.step import (
    DraftWithLoss,
    compile_draft,
    pack_micro_batch,
    param_groups,
    setup_moe_balance,
)


def warmup_cosine_ratio(iteration: int, total_steps: int, warmup_steps: int, cos_min_ratio: float) -> float:
    """DeepSpeed's WarmupCosineLR (linear warmup from 0) as a multiplier of each group's lr, where `iteration`
    is its `last_batch_iteration` (-1 before the first scheduler step)."""
    if iteration < 0:
        return 0.0
    warmup = max(2, warmup_steps)
    if iteration < warmup:
        return iteration / warmup
    progress = min(1.0, (iteration - warmup + 1) / max(1, total_steps - warmup))
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)


class TorchEngine:
    """The slice of DeepSpeed's engine interface that the training loop uses, on plain torch."""

    def __init__(self, module: nn.Module, cfg: RunConfig) -> None:
        t = cfg.train
        self.module = module
        self.grad_accum, self.grad_clip = t.grad_accum, t.grad_clip
        self.optimizer = torch.optim.AdamW(param_groups(module, cfg), lr=t.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay, fused=True)  # as deepspeed_config's
        # LambdaLR's epoch e = scheduler steps taken = DeepSpeed's last_batch_iteration + 1
        ratio = partial(warmup_cosine_ratio, total_steps=t.max_steps, warmup_steps=max(t.warmup_steps, 1),
                        cos_min_ratio=t.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda e: ratio(e - 1))
        self._micro = 0
        # train.precision=bf16 here is autocast: bf16 matmuls, fp32 master weights, optimizer and loss reductions
        self.autocast_dtype = torch.bfloat16 if t.precision == "bf16" else None

    def __call__(self, batch: BlockBatch):
        device_type = batch.input_ids_T.device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            return self.module(batch)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.grad_accum:
            return
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        """<save_dir>/<tag>/: model.safetensors (the module's state, frozen target weights excluded),
        optimizer.pt and scheduler.pt (tensors and plain values only: loadable with weights_only=True)."""
        from safetensors.torch import save_file

        if self._micro % self.grad_accum:
            raise RuntimeError("a checkpoint between micro-steps would lose the accumulated gradients")
        out = Path(save_dir) / tag
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.module.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), out / "scheduler.pt")

    def load_checkpoint(self, load_dir: str, tag: str, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> tuple[str | None, dict]:
        """Restore what `save_checkpoint` wrote; (None, {}) when it is not there, as DeepSpeed answers."""
        from safetensors.torch import load_file

        src = Path(load_dir) / tag
        if not (src / "model.safetensors").is_file():
            return None, {}
        device = next(self.module.parameters()).device
        self.module.load_state_dict(load_file(str(src / "model.safetensors"), device=str(device)), strict=True)
        if load_optimizer_states:
            self.optimizer.load_state_dict(torch.load(src / "optimizer.pt", map_location=device, weights_only=True))
        if load_lr_scheduler_states:
            self.scheduler.load_state_dict(torch.load(src / "scheduler.pt", weights_only=True))
        return str(src), {}


class LocalBatches:
    """Micro-batches from an in-process TargetWorker. `start(step)` hands the step to one background thread,
    so the target encodes step s+1 while step s trains; steps are made one at a time, in order, so the features
    are the ones a sequential run makes."""

    def __init__(self, worker: Any, samples: list, cfg: RunConfig, device: torch.device) -> None:
        self.worker, self.samples, self.cfg, self.device = worker, samples, cfg, device
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self._pending: dict[int, Future] = {}

    def _make(self, step: int) -> list[MicroBatch]:
        cfg, out = self.cfg, []
        for m in range(cfg.train.grad_accum):
            b = batch_index_for(step, m, 0, cfg.train.grad_accum, 1)
            ids = batch_sample_ids(b, len(self.samples), cfg.data.samples_per_batch, cfg.data.seed)
            fb = self.worker.encode(b, [self.samples[i] for i in ids])
            out.append(pack_micro_batch(fb, b, cfg, len(self.samples), torch.float32, self.device))
        return out

    def start(self, step: int) -> None:
        self._pending[step] = self._pool.submit(self._make, step)

    def take(self, step: int) -> list[MicroBatch]:
        return self._pending.pop(step).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()


def train_single_process(cfg: RunConfig, log: logging.Logger, device: str = "auto",
                         resume_from: Path | None = None) -> Path:
    """Train `cfg` to the end in this process, from checkpoint `resume_from` if given; returns the export
    directory."""
    from pipeline.sample_store import samples_digest as digest_samples
    from workers.orchestrate import InputError, check_resume, check_samples, resolve_inputs
    from workers.target.worker import TargetWorker

    on_gpu = device != "cpu" and (device != "auto" or torch.cuda.is_available())
    if cfg.train.precision == "bf16" and not on_gpu:
        raise InputError("train.precision=bf16 (autocast) on a CPU is 30-70x slower than fp32 on CPUs without "
                         "AMX: set train.precision=fp32, or run on a GPU")
    if cfg.target.tp_size > 1:
        raise InputError(f"--single-process holds the whole target in this process: target.tp_size must be 1, "
                         f"got {cfg.target.tp_size} (target groups need the Ray pipeline)")
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
                          device=str(dev), max_tokens_per_forward=cfg.target.max_tokens_per_forward)
    vocab, hidden, layers = worker.info()
    try:
        cfg.draft = cfg.draft.resolved_for_target(vocab, hidden, layers)
    except ValueError as e:
        raise InputError(str(e)) from e
    torch.manual_seed(cfg.train.seed)
    embed_VD, lm_head_VD = worker.embedding_weights()
    module = DraftWithLoss(build_draft(cfg.draft, embed_VD, lm_head_VD), cfg.loss).to(dev)
    setup_moe_balance(module.draft)
    if cfg.train.compile:
        compile_draft(module.draft)
    engine = TorchEngine(module, cfg)
    ckpts = CheckpointManager(run_dir, cfg.checkpoint.keep_last)
    run_dir.mkdir(parents=True, exist_ok=True)
    samples_digest = digest_samples(samples)  # what the ledger's sample ids refer to (no samples file: in memory)
    if meta is not None:
        check_samples(meta, samples_digest)
    start_step, ledger = resume(engine, ckpts, resume_from, 0, log, samples_digest)

    save_config(cfg, run_dir / "config.yaml")
    sink = JsonlSink(str(run_dir / "metrics.jsonl"))
    log.info("single-process training of a %s draft (%d layers, head %s, gamma %d) on %s for %d steps; %d samples;"
             " %s", cfg.draft.arch, cfg.draft.num_layers, cfg.draft.head, cfg.draft.block_size, dev,
             cfg.train.max_steps, len(samples), f"resuming from {resume_from}" if resume_from else "fresh start")
    t_start = time.time()
    try:
        with stop_on_signal(lambda _name: None) as stop:
            result = fit(engine, LocalBatches(worker, samples, cfg, dev), ckpts, sink, cfg, 0, 1, start_step, log,
                         ledger=ledger, poll=lambda: Notice(stop=stop.is_set()),
                         num_samples=len(samples))
    finally:
        sink.close()
    if result.stopped_at is not None:
        raise StoppedEarly(result.stopped_at, cfg.train.max_steps)
    state = {k: v.detach().float().cpu() for k, v in module.draft.state_dict().items()}
    out = export_draft(state, export_meta(cfg), run_dir / "export")
    log.info("exported the draft to %s (%.0f s)", out, time.time() - t_start)
    return Path(out)
