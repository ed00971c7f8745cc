"""Draft training in one process on one device, without Ray or DeepSpeed.

The pieces are the distributed pipeline's own: `TargetWorker.encode` makes the features (rounded through the wire
dtype, as on the object store), pipeline/order.py fixes the batch order, pipeline/packing.py packs the blocks, and
`optimizer_step` from workers/train_step.py runs the step. Only the engine differs: `TorchEngine` is torch's AdamW,
gradient-norm clipping and a LambdaLR that follows DeepSpeed's WarmupCosineLR step for step; with the same config
it updates the parameters exactly as the DeepSpeed engine does (tests/test_single_process.py checks this).

Use it on one GPU or CPU where Ray and DeepSpeed are not installed (bench/drafters.py on a lent accelerator) and
for debugging. It writes metrics.jsonl, config.yaml and the export, but no resumable checkpoints: runs that must
survive a stop go through launch/train_v4_draft.py. The draft trains in fp32 (TF32 matmuls on CUDA); the target
runs in target.dtype.
"""

from __future__ import annotations

import logging
import math
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from draft_model.batch import BlockBatch
from draft_model.registry import build_draft
from pipeline.config import RunConfig, save_config
from pipeline.metrics import JsonlSink
from pipeline.order import batch_index_for, batch_sample_ids
from pipeline.packing import PackStats
from workers.checkpoint import export_draft
from workers.train_step import (
    DraftWithLoss,
    export_meta,
    format_step,
    optimizer_step,
    pack_micro_batch,
    param_groups,
    step_metrics,
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
    """The slice of DeepSpeed's engine interface that `optimizer_step` uses, on plain torch."""

    def __init__(self, module: nn.Module, cfg: RunConfig) -> None:
        t = cfg.train
        self.module = module
        self.grad_accum, self.grad_clip = t.grad_accum, t.grad_clip
        self.optimizer = torch.optim.AdamW(param_groups(module, cfg), lr=t.lr, betas=tuple(t.betas),
                                           weight_decay=t.weight_decay)
        # LambdaLR's epoch e = scheduler steps taken = DeepSpeed's last_batch_iteration + 1
        ratio = partial(warmup_cosine_ratio, total_steps=t.max_steps, warmup_steps=max(t.warmup_steps, 1),
                        cos_min_ratio=t.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda e: ratio(e - 1))
        self._micro = 0

    def __call__(self, batch: BlockBatch):
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


def train_single_process(cfg: RunConfig, log: logging.Logger, device: str = "auto") -> Path:
    """Train `cfg` to the end in this process; returns the export directory."""
    from workers.orchestrate import InputError, resolve_inputs
    from workers.target_worker import TargetWorker

    if cfg.train.precision != "fp32":
        raise InputError("the single-process trainer trains in fp32 (TF32 on CUDA); bf16 master-weight training "
                         "is DeepSpeed's: use launch/train_v4_draft.py, or set train.precision=fp32")
    run_dir = Path(cfg.checkpoint.run_dir)
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "export").exists():
        raise InputError(f"{run_dir} already holds a run (metrics.jsonl or export/); a single-process run cannot "
                         "resume or share a run dir: use a new one")
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
    engine = TorchEngine(module, cfg)

    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    sink = JsonlSink(str(run_dir / "metrics.jsonl"))
    log.info("single-process training of a %s draft (%d layers, head %s, gamma %d) on %s for %d steps; %d samples",
             cfg.draft.arch, cfg.draft.num_layers, cfg.draft.head, cfg.draft.block_size, dev, cfg.train.max_steps,
             len(samples))
    t_start = time.time()
    try:
        for step in range(cfg.train.max_steps):
            t0 = time.time()
            micro: list[tuple[BlockBatch, PackStats, int]] = []
            for m in range(cfg.train.grad_accum):
                b = batch_index_for(step, m, 0, cfg.train.grad_accum, 1)
                ids = batch_sample_ids(b, len(samples), cfg.data.samples_per_batch, cfg.data.seed)
                fb = worker.encode(b, [samples[i] for i in ids])
                micro.append(pack_micro_batch(fb, b, cfg, len(samples), torch.float32, dev))
            t_data = time.time() - t0
            acc, global_w = optimizer_step(engine, micro, cfg.loss.decay_lambda, 1)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            metrics = step_metrics(list(acc.values()), global_w, cfg, 1, time.time() - t0, t_data,
                                   engine.get_lr()[0], step + 1)
            sink.log(step + 1, metrics)
            if (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.max_steps:
                eta = (time.time() - t_start) / (step + 1) * (cfg.train.max_steps - step - 1)
                log.info("%s", format_step(step + 1, cfg.train.max_steps, metrics, eta))
    finally:
        sink.close()
    state = {k: v.detach().float().cpu() for k, v in module.draft.state_dict().items()}
    out = export_draft(state, export_meta(cfg), run_dir / "export")
    log.info("exported the draft to %s (%.0f s)", out, time.time() - t_start)
    return Path(out)
