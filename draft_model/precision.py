"""What `auto` means for a compute dtype: bf16 where the device multiplies bf16 natively, fp32 elsewhere.

bf16 matmuls pay off on a GPU with bf16 tensor cores and on a CPU with AMX or AVX512-BF16 (oneDNN runs them
natively there); on any other CPU torch emulates them, and the loss's LM-head matmuls ran 5-70x slower than in fp32
(docs/design-notes.md). The answer comes from torch's own capability checks, so it is the device's, not a guess
from a model name. `resolve_matmul_dtype` is the one place that decides; the trainers call it once, early, on the
process that trains (workers/trainer/precision.py), log the choice and save it in every checkpoint's config, so a
resume keeps it. The loss calls it too, for callers that hand it `auto` (tests, benches).

Run its tests: python -m pytest tests/test_compute_dtype.py -q
"""

from __future__ import annotations

import functools

import torch

AUTO = "auto"


@functools.lru_cache(maxsize=1)
def cpu_bf16_support() -> tuple[bool, str]:
    """(whether this CPU multiplies bf16 natively, the feature that decided it and torch's vector capability)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # True on plain AVX512 too (emulated there)
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    avx512_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    if onednn and amx:
        return True, f"CPU with AMX, {capability}"
    if onednn and avx512_bf16:
        return True, f"CPU with AVX512-BF16, {capability}"
    return False, f"CPU without native bf16 matmuls, {capability}"


def cuda_bf16_support(device: torch.device) -> tuple[bool, str]:
    """(whether this GPU has bf16 tensor cores, its name); emulated bf16 (before Ampere) counts as no."""
    name = torch.cuda.get_device_name(device)
    with torch.cuda.device(device):
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    return native, f"GPU {'with' if native else 'without'} bf16 tensor cores, {name}"


def resolve_matmul_dtype(requested: str, device: torch.device | str) -> tuple[str, str]:
    """("bfloat16" | "float32", why) for a compute dtype setting on `device`: an explicit value is kept as it is;
    `auto` is bfloat16 where the device multiplies bf16 natively (a GPU with bf16 tensor cores, a CPU with AMX or
    AVX512-BF16) and float32 elsewhere."""
    if requested != AUTO:
        return requested, "as configured"
    device = torch.device(device)
    if device.type == "cuda":
        native, what = cuda_bf16_support(device)
    elif device.type == "cpu":
        native, what = cpu_bf16_support()
    else:  # mps, xpu, ...: not measured here; fp32 is the safe side
        native, what = False, f"{device.type} device, not measured"
    return ("bfloat16" if native else "float32"), f"auto: {what}"
