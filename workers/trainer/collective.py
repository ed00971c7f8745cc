"""Where a collective's tensor must live: on the device the process group's backend serves.

Torch maps each backend to the device types it handles (`dist.Backend.backend_capability`): gloo serves cpu (and
cuda), NCCL cuda only. Ray Train forms a pure `nccl` group for GPU trainers, so a CPU tensor handed to
`dist.all_reduce` there raises `RuntimeError: No backend type associated with device type cpu` (NCCL does not copy
it for us). `collective_device` answers from the group's own backend config, so one helper serves a gloo group on
the CPU, an NCCL group on a GPU and a mixed `cpu:gloo,cuda:nccl` group (the host is preferred: no device round trip
for a few scalars).

Run: python -m pytest -q tests/test_gpu_collectives.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_devices(group=None) -> set[str]:
    """The device types the group's backend handles, e.g. {"cuda"} for "nccl" or "cuda:fake", {"cpu", "cuda"}
    for "gloo"."""
    devices: set[str] = set()
    for part in dist.get_backend_config(group).split(","):
        part = part.strip().lower()
        if ":" in part:  # "device:backend"
            devices.add(part.split(":", 1)[0])
        else:
            devices.update(dist.Backend.backend_capability.get(part, ["cpu"]))
    return devices


def collective_device(group=None) -> torch.device:
    """The device for a collective's tensor on `group` (default: the world): the CPU when torch.distributed is
    not initialised (one process: collectives are no-ops) or the backend serves the CPU, else the current CUDA
    device (what torchrun/Ray Train bound this rank to)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    devices = backend_devices(group)
    if "cpu" in devices:
        return torch.device("cpu")
    if "cuda" in devices:
        return torch.device("cuda", torch.cuda.current_device())
    raise RuntimeError(f"process group backend {dist.get_backend_config(group)!r} serves neither cpu nor cuda")
