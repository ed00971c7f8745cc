"""Dense SwiGLU feed-forward (the dense FFN of a draft layer, and the MoE's shared experts), with DeepSeek-V4's
optional clamp."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, limit: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x_TD), self.up_proj(x_TD), self.limit))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) * up; with limit > 0, DeepSeek-V4's clamp: silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up
