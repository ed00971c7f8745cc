"""FLOPs of a call as torch.utils.flop_counter counts them, with the MoE's grouped GEMMs included.

    from flops import count_flops            # bench/ scripts import it by its own name
    n = count_flops(trainer.step)

FlopCounterMode has no formula for `torch._grouped_mm` (torch 2.13) and counts it as 0, which left the routed
experts out of bench/gpu_smoke.py's tflops (issue #47: 9.6e7 counted at the tiny shape against 2.4e8 with the dense
expert loop). The formula below is registered once, on import; tests/test_gpu_smoke.py checks it against the dense
loop's count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x (multiply-adds) of one grouped GEMM, for each of its operand layouts (offs split one dimension in groups):
    2D x 2D: groups along K, (M, K) @ (K, N) -> (G, M, N): 2 M K N; otherwise K is the last dim of `a` and every
    output element is one K-long dot product: 2 x numel(out) x K (2D x 3D: (M, K) @ (G, K, N) -> (M, N); 3D x 2D:
    (G, M, K) @ (K, N) -> (M, N); 3D x 3D: batched)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


if hasattr(torch.ops.aten, "_grouped_mm"):
    register_flop_formula(torch.ops.aten._grouped_mm)(grouped_mm_flops)


def count_flops(fn: Callable[[], object]) -> int:
    """The FLOPs `fn()` runs (matmuls, convolutions, attention, grouped GEMMs)."""
    with FlopCounterMode(display=False) as fc:
        fn()
    return int(fc.get_total_flops())
