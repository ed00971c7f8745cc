"""Draft architectures by name: a new architecture is a new file plus `@register_draft("name")`, imported by
draft_model/__init__.py (which every import of this package runs first, so DRAFTS is complete whenever it is read).
This module imports no architecture: the model files import it, never the other way round."""

from __future__ import annotations

import contextvars
from collections.abc import Callable

import torch
from torch import nn

from draft_model.config import DraftConfig

DRAFTS: dict[str, type[nn.Module]] = {}


def register_draft(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def decorator(cls: type[nn.Module]) -> type[nn.Module]:
        if name in DRAFTS and DRAFTS[name] is not cls:
            raise ValueError(f"draft architecture {name!r} is already registered by {DRAFTS[name].__qualname__}")
        DRAFTS[name] = cls
        return cls
    return decorator


def build_draft(cfg: DraftConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                frozen_dtype: torch.dtype | None = None) -> nn.Module:
    """Instantiate `cfg.arch` on the target's frozen embedding [V, D] and LM head [V, D], stored in `frozen_dtype`
    (None: torch's default dtype; `frozen_weights_dtype`)."""
    if cfg.arch not in DRAFTS:
        raise ValueError(f"unknown draft.arch {cfg.arch!r}; known architectures: {sorted(DRAFTS)}")
    token = _FROZEN_DTYPE.set(frozen_dtype)
    try:
        return DRAFTS[cfg.arch](cfg, embed_weight, lm_head_weight)
    finally:
        _FROZEN_DTYPE.reset(token)


_FROZEN_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("frozen_dtype", default=None)


def frozen_weights_dtype() -> torch.dtype | None:
    """The dtype the draft being built stores the target's frozen embedding and LM head in (None: torch's default
    dtype; draft_model/model.register_frozen_target_weights reads it). The trainers build in their training dtype:
    DeepSpeed casts the parameters to bf16 but never buffers, so an fp32 default would keep an fp32 copy of both
    resident (3.95 GiB at v4 shapes) and the loss would cast the head to bf16 on every micro-batch."""
    return _FROZEN_DTYPE.get()
