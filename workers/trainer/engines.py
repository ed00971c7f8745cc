"""The engines a trainer steps the draft with, both behind DeepSpeed's engine interface (`engine(batch)`,
`backward`, `step`, `get_lr`, `save_checkpoint`, `load_checkpoint`), which is all the shared loop
(workers/trainer/loop.py) knows of them:

- DeepSpeed (the Ray trainers, ray_trainer.py): `deepspeed_config` (ZeRO stage, bf16, torch's fused AdamW, the
  WarmupCosineLR schedule), `deepspeed_engine`, and `resumed_engine`, which restores a checkpoint, through
  DeepSpeed's universal checkpoint when it was written by another world size (reshard.py);
- `TorchEngine` (the single-process trainer, single_process.py): torch's AdamW, gradient-norm clipping and a
  LambdaLR that follows DeepSpeed's WarmupCosineLR step for step; with the same config it updates the parameters
  exactly as the DeepSpeed engine does (tests/test_trainer_step.py).

Nothing here imports Ray, and DeepSpeed only inside `deepspeed_engine`, so the single-process trainer runs where
neither is installed.
"""

from __future__ import annotations

import importlib
import math
import warnings
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from draft_model.batch import BlockBatch
from pipeline.config import RunConfig
from pipeline.metrics import drop_log_message
from workers.trainer.checkpoint import CheckpointManager
from workers.trainer.ledger import Ledger
from workers.trainer.loop import resume, resume_ledger
from workers.trainer.reshard import load_universal, universal_source
from workers.trainer.step import DraftWithLoss, param_groups


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
        # CUDA): one pass per tensor instead of about a dozen (docs/design-notes.md, "Measured kernels")
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay,
                                                  "torch_adam": True, "fused": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.max_steps, "warmup_num_steps": max(t.warmup_steps, 1),
            "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr_ratio, "warmup_type": "linear"}},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


SHM_NOTICE = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"


def quiet_deepspeed() -> None:
    """Silence, by their text, DeepSpeed 0.19.8's known-harmless messages in a trainer, every other one left to print:
    its ZeRO all-gathers call torch's deprecated name (a FutureWarning on every step of every rank, nothing a user
    can act on); its learning-rate query before the scheduler's first step (a warning per rank); and the notice it
    print()s on every comm-backend start, cached op or not (per rank, per restart, at shutdown)."""
    # import_module, not `import deepspeed.comm.torch as ...`: that name resolves to the torch package, which
    # deepspeed.comm imports as an attribute called `torch`
    ds_comm = importlib.import_module("deepspeed.comm.torch")

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    drop_log_message("DeepSpeed", "Attempting to get learning rate from scheduler before it has started")

    def print_but_the_notice(*args, **kwargs) -> None:  # the module's print: its only print() is that notice
        if not (args and str(args[0]) == SHM_NOTICE):
            print(*args, **kwargs)

    ds_comm.print = print_but_the_notice


def deepspeed_engine(module: DraftWithLoss, cfg: RunConfig, load_universal: bool = False) -> Any:
    """`module` under DeepSpeed with the run's optimizer groups, ZeRO stage and schedule (torch.distributed must be
    initialised). Under ZeRO-3 the sequential head's W2 is read by DraftWithLoss.forward, outside any forward of
    the head itself, so it is registered as the module's external parameter: gathered for the loss's forward
    and, through the hooks on DraftWithLoss's output tensors, again for its backward."""
    import deepspeed

    quiet_deepspeed()
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
