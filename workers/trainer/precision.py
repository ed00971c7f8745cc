"""The trainer's compute dtypes, fixed once per (re)start on the process that trains, before the draft's loss is
built: the trainer's device decides an `auto` (draft_model/precision.py), not the driver's, and a resumed run keeps
the value its checkpoint recorded (pipeline/resume.py, RESOLVED_ON_TRAINER), wherever it lands. The resolved value
goes into the run config that every checkpoint saves. Used by the Ray trainers (rank 0 decides for all) and the
single-process trainer alike.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draft_model.precision import AUTO, resolve_matmul_dtype
from pipeline.config import RunConfig
from pipeline.resume import kept_choice


def loss_matmul_dtype(requested: str, device: torch.device | str, resume_from: Path | None) -> tuple[str, str]:
    """(the loss's matmul dtype, why) for a trainer on `device` resuming from `resume_from` (None: fresh)."""
    if requested == AUTO and resume_from is not None:
        kept = kept_choice(json.loads((Path(resume_from) / "meta.json").read_text()), "loss.matmul_dtype")
        if kept != AUTO:
            return kept, f"auto: kept from {Path(resume_from).name}, where the run chose it"
    return resolve_matmul_dtype(requested, device)


def describe(dtype: str, why: str) -> str:
    """The trainer's first log line: `loss matmuls: float32 (auto: CPU without native bf16 matmuls, AVX2)`."""
    return f"loss matmuls: {dtype} ({why})"


def frozen_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The dtype the frozen embedding and LM head are stored in: bf16 when the engine trains in bf16 and the loss
    multiplies in bf16 (DeepSpeed casts parameters, never buffers: left at the default they would stay an fp32
    copy that the loss casts every micro-batch); else the default (fp32), which a `loss.matmul_dtype=float32`
    run keeps for its vocabulary matmuls."""
    return torch.bfloat16 if cfg.train.precision == "bf16" and cfg.loss.matmul_dtype == "bfloat16" else None
