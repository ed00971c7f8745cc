"""The trainers' torch.distributed group as Ray Train forms it, on loopback when the cluster is this host alone.

Ray Train's TorchConfig has rank 0 pick MASTER_ADDR (its node's IP) and a free port, and every rank calls
`init_process_group("env://")`: rank 0's TCPStore then listens on every interface (workers/loopback.py). On a
local cluster `trainer_torch_config` returns `LoopbackTorchConfig`, whose backend does the same rendezvous with
a store bound to 127.0.0.1 and gloo/NCCL on the loopback interface; any other cluster keeps Ray Train's own.

Run: python -m pytest tests/test_loopback.py -q
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray.train
import torch.distributed as dist
from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

from workers.loopback import LOOPBACK, is_local_cluster, join_store, serve_store, use_loopback_interface

_STORE: Any = None  # rank 0's store server, held for the life of this worker process


def trainer_torch_config(nodes: list[dict[str, Any]]) -> TorchConfig:
    """The TorchConfig for the trainers on the cluster whose ray.nodes() are `nodes`."""
    return LoopbackTorchConfig() if is_local_cluster(nodes) else TorchConfig()


def _serve(world_size: int, timeout_s: float) -> int:
    global _STORE
    _STORE = serve_store(LOOPBACK, world_size, timedelta(seconds=timeout_s))
    return _STORE.port


def _join(backend: str, rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """One rank joins the group: the env of torchrun (DeepSpeed reads it), then the process group on the store."""
    ctx = ray.train.get_context()
    os.environ.update({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(ctx.get_local_rank()),
                       "LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()), "NODE_RANK": str(ctx.get_node_rank())})
    use_loopback_interface()
    if backend == "nccl":  # as Ray Train does: a timed-out collective fails instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = timedelta(seconds=timeout_s)
    store = _STORE if rank == 0 else join_store(LOOPBACK, port, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class _LoopbackTorchBackend(_TorchBackend):
    """Ray Train's torch backend with its rendezvous on loopback; shutdown and the rest are Ray Train's."""

    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        world = len(worker_group)
        port = worker_group.execute_single(0, _serve, world, backend_config.timeout_s)
        ray.get([worker_group.execute_single_async(rank, _join, backend, rank, world, port, backend_config.timeout_s)
                 for rank in range(world)])


@dataclass
class LoopbackTorchConfig(TorchConfig):
    @property
    def backend_cls(self) -> type:
        return _LoopbackTorchBackend
