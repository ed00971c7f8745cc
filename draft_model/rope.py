"""Rotary position embedding over absolute positions inside a sequence.

The inverse frequencies are recomputed in fp32 on every call instead of living in a buffer: a buffer would be
cast to bf16 by `model.to(torch.bfloat16)`, and bf16 inverse frequencies shift the angles of far positions by
whole radians, which measurably lowers acceptance (DESIGN.md §1). The rotation itself is also done in fp32 and
only the result is cast back to the input dtype.

Legend: L positions (any leading shape), H heads, E head dim.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [E/2] inverse frequencies theta^(-2i/E)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    return 1.0 / (theta ** exponent)


def rope_tables(pos_L: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [..., 1, E] for integer positions pos [...]: computed once per forward and shared by every
    layer (all draft layers have the same head dim and theta)."""
    inv_freq = rope_inv_freq(head_dim, theta, pos_L.device)
    angle_LE2 = pos_L.to(torch.float32)[..., None] * inv_freq  # fp32: exact positions up to 2^24
    cos_L1E = torch.cat([angle_LE2.cos(), angle_LE2.cos()], dim=-1)[..., None, :]
    sin_L1E = torch.cat([angle_LE2.sin(), angle_LE2.sin()], dim=-1)[..., None, :]
    return cos_L1E, sin_L1E


def apply_rope(x_LHE: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [..., H, E] by `rope_tables` of its positions (rotate-half convention), in fp32."""
    cos_L1E, sin_L1E = tables
    x = x_LHE.to(torch.float32)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos_L1E + rotated * sin_L1E).to(x_LHE.dtype)


class RotaryEmbedding(nn.Module):
    """Holds no tensors on purpose (see module docstring); `forward(x, pos)` rotates x (tables built per call:
    the one-off form; the draft backbone builds `rope_tables` once per forward instead)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        rope_inv_freq(head_dim, theta)  # validate early
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x_LHE: torch.Tensor, pos_L: torch.Tensor) -> torch.Tensor:
        """x [..., H, E] at integer positions pos [...] (same leading shape); rotate-half convention."""
        return apply_rope(x_LHE, rope_tables(pos_L, self.head_dim, self.theta))
