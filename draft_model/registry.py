"""Draft architectures by name: a new architecture is a new file plus `@register_draft("name")`, imported by
draft_model/__init__.py (which every import of this package runs first, so DRAFTS is complete whenever it is read).
This module imports no architecture: the model files import it, never the other way round."""

from __future__ import annotations

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
    (None: torch's default dtype; draft_model/model.frozen_weights_dtype)."""
    from draft_model.model import frozen_weights_dtype

    if cfg.arch not in DRAFTS:
        raise ValueError(f"unknown draft.arch {cfg.arch!r}; known architectures: {sorted(DRAFTS)}")
    with frozen_weights_dtype(frozen_dtype):
        return DRAFTS[cfg.arch](cfg, embed_weight, lm_head_weight)
