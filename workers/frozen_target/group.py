"""Target groups: one frozen target sharded over `target.tp_size` Ray actors by transformers' tensor (and expert)
parallelism, seen by the feature service exactly as one target worker.

    FeatureService ──encode(b, samples)──> TargetGroup (in the service's process: no actor, no data)
                                             ├─> member 0 (rank 0) ─ FeatureBatch ──> the trainer, via its ref
                                             ├─> member 1 (rank 1) ─ None
                                             └─> ...       one torch.distributed group: gloo on CPU, NCCL on GPU

- Placement: one Ray placement group per group, STRICT_PACK (every member on one node: the collectives of every
  layer stay on NVLink/shared memory), one bundle per member with its CPUs, GPU and custom resources.
- Rendezvous: member 0 starts the group's TCPStore on its node's IP, and on that address only (workers/loopback.py:
  on a local cluster, loopback); the address and port are MASTER_ADDR/MASTER_PORT. The members' `setup` calls take
  that answer as a Ray argument, so a group forms without the service waiting on it (later calls queue behind
  `setup` on each member: Ray runs one caller's calls to an actor in order).
- Every member runs the same forward on the same samples (one object-store copy, read by all). Under tensor
  parallelism the residual stream is replicated (row-parallel outputs are all-reduced inside each layer), so rank 0
  already holds the whole features: it alone encodes and returns the FeatureBatch, the others return None.
- Calls that reach every member (encode, embedding_weights) are submitted under one lock, so every member sees
  them in the same order and their collectives pair up.

Faults. A member alone is useless: its peers block in, or fail out of, the next collective. So a member that fails
inside a forward or a collective exits its process (an error about the input, a ValueError, is raised normally:
every member raises it alike), the refs of all its calls fail with RayActorError, and the trainer asks the feature
service for the batch again (workers/trainer/ray_trainer.py); the group notices the dead member on that next call, kills
the rest, starts a whole new group in the same placement group and runs the batch there. Batches are pure functions of
their index, so the re-run is exact. At most `target.max_restarts` group restarts (-1 = without limit).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import ray

from workers.loopback import is_loopback, join_store, serve_store, use_loopback_interface
from workers.oom import OutOfMemory, first_line

log = logging.getLogger(__name__)

# Errors a member raises as a task error, keeping its process: bad input or a target that cannot be loaded (the
# same on every member, so a restart would not help), and running out of GPU memory (workers/oom.py: the same batch
# runs out again on a restarted group; fatal to the run, one line). Anything else inside a forward or a collective
# ends it.
_INPUT_ERRORS = (ValueError, FileNotFoundError, ImportError, OutOfMemory)

# Every member sees all of its node's GPUs, as under torchrun, and binds the one Ray gave its bundle: NCCL then
# finds its peers' devices (P2P/NVLS over NVLink) instead of each process seeing a single GPU
# (ray-project/ray#61073: slow first collectives and hangs on NVSwitch nodes otherwise).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def member_options(bundle: dict[str, float], resources: dict | None, pg: Any, rank: int) -> dict[str, Any]:
    """Ray actor options of member `rank`: its bundle of the group's placement group (bundle index = rank, every
    bundle on one node), and for a GPU member every GPU of the node visible."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=resources or None,
                   max_restarts=0, max_task_retries=0,
                   scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank))
    if bundle.get("GPU"):
        options["runtime_env"] = {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    return options


def bind_gpu(rank: int) -> int:
    """Bind this member to its GPU the way torchrun does: LOCAL_RANK = its index in the group (its placement-group
    bundle; a group is one node), `torch.cuda.set_device` to the GPU Ray assigned that bundle, as an index among the
    GPUs this process sees (all of the node's, CUDA_VISIBLE_DEVICES left unset by Ray). Returns that index."""
    import torch

    gpu = str(ray.get_gpu_ids()[0])
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    index = visible.index(gpu) if gpu in visible else int(gpu)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.cuda.set_device(index)
    return index


class TargetGroupMember:
    """One rank of a target group: a TargetWorker holding this rank's shards of the target."""

    def __init__(self) -> None:
        self.rank = -1
        self._store = None  # the group's TCPStore server, on rank 0 (rendezvous)
        self._worker = None
        self._setup_error: BaseException | None = None

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        """(MASTER_ADDR, MASTER_PORT) for the group, asked of rank 0: its node's address and the port of the group's
        store, started here and listening on that address only (torch's own would listen on every interface:
        workers/loopback.py)."""
        host = ray.util.get_node_ip_address()
        self._store = serve_store(host, None, timedelta(minutes=5))
        return host, self._store.port

    def setup(self, address: tuple[str, int], rank: int, world: int, backend: str, target_path: str,
              layers: list[int], options: dict[str, Any], expert_parallel: bool, timeout_s: float) -> None:
        import torch
        import torch.distributed as dist

        from workers.frozen_target.sharding import distributed_config
        from workers.frozen_target.worker import TargetWorker

        self.rank = rank
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": address[0], "MASTER_PORT": str(address[1])})
        if is_loopback(address[0]):  # a local cluster: gloo's and NCCL's sockets on loopback too
            use_loopback_interface()
        timeout = timedelta(seconds=timeout_s)
        try:
            if backend == "nccl":
                bind_gpu(rank)
            assert rank != 0 or self._store is not None, "rank 0 serves the store: rendezvous runs on it first"
            store = self._store if rank == 0 else join_store(address[0], address[1], world, timeout)
            store.set_timeout(timeout)
            # a collective still waiting after a whole batch's time means a lost peer: fail rather than hang
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
            self._worker = TargetWorker(target_path, layers, distributed=distributed_config(world, expert_parallel),
                                        **options)
        except torch.OutOfMemoryError as e:  # loading: the same weights do not fit on a restart either
            self._setup_error = OutOfMemory(f"target rank {rank} ran out of GPU memory loading {target_path} "
                                            f"({first_line(e)}); give the target more GPUs (target.tp_size, "
                                            "target.expert_parallel) or a smaller checkpoint dtype")
        except _INPUT_ERRORS as e:
            self._setup_error = e
        except BaseException as e:  # a peer lost while forming the group, or loading failed mid-collective
            self._die(f"setup failed: {type(e).__name__}: {e}")

    def _ready(self):
        if self._setup_error is not None:
            raise self._setup_error
        assert self._worker is not None, "setup has not run"
        return self._worker

    def _die(self, why: str) -> None:
        log.error("target group member rank %d exits: %s", self.rank, why)
        print(f"target group member rank {self.rank} exits: {why}", file=sys.stderr, flush=True)
        os._exit(1)

    def info(self) -> tuple[int, int, int]:
        return self._ready().info()  # shapes only: no collective, so rank 0 answers it alone

    def param_bytes(self) -> int:
        return self._ready().param_bytes()

    def embedding_weights(self):
        """Gathered from the shards (a collective: every member is called); rank 0 returns them."""
        worker = self._ready()
        try:
            weights = worker.embedding_weights()
        except _INPUT_ERRORS:
            raise
        except Exception as e:
            self._die(f"embedding_weights: {type(e).__name__}: {e}")
        return weights if self.rank == 0 else None

    def encode(self, batch_index: int, samples: list, cache: str | None = None) -> tuple[Any, None]:
        """(FeatureBatch on rank 0 / None elsewhere, a small done token the group polls for dead members); rank 0,
        which holds the whole features, stores them in the feature cache `cache` when given."""
        worker = self._ready()
        try:  # only rank 0 copies its features to the host: the others run the forward for its collectives
            batch = worker.encode(batch_index, samples, cache if self.rank == 0 else None, host_copy=self.rank == 0)
        except _INPUT_ERRORS:
            raise
        except Exception as e:
            self._die(f"batch {batch_index}: {type(e).__name__}: {e}")
        return (batch if self.rank == 0 else None), None


class Method:
    """`.remote(...)` like an actor method's, so the feature service calls a group (or a vLLM replica,
    workers/frozen_target/vllm_worker.py) as it calls one worker."""

    def __init__(self, fn) -> None:
        self.remote = fn


class TargetGroup:
    """`target["tp_size"]` members in one placement group, restarted as a whole when one dies."""

    def __init__(self, index: int, target: dict[str, Any], layers: list[int]) -> None:
        from workers.frozen_target.placement import fresh_placement_group, group_name

        self.index, self.size = index, int(target["tp_size"])
        self._target, self._layers = target, list(layers)
        gpus = float(target["gpus_per_worker"])
        self._bundle = {"CPU": float(target["cpus_per_worker"]), **({"GPU": gpus} if gpus else {}),
                        **(target["resources_per_worker"] or {})}
        self._pg = fresh_placement_group([dict(self._bundle) for _ in range(self.size)], "STRICT_PACK",
                                         group_name("target-group", index))
        self._lock = threading.Lock()
        self.restarts = 0
        self._members: list[Any] = []
        self._tokens: list[ray.ObjectRef] = []  # refs of the calls in flight, polled for a dead member
        self._fatal: BaseException | None = None  # a member's OutOfMemory: every later call raises it
        self._start()
        self.encode = Method(self._encode)
        self.embedding_weights = Method(self._embedding_weights)
        self.info = Method(lambda: self._members[0].info.remote())

    def _start(self) -> None:
        t = self._target
        actor = ray.remote(TargetGroupMember)
        self._members = [
            actor.options(**member_options(self._bundle, t["resources_per_worker"], self._pg, rank)).remote()
            for rank in range(self.size)
        ]
        address = self._members[0].rendezvous.remote()
        options = {"compute_dtype": t["dtype"], "wire_dtype": t["wire_dtype"],
                   "max_tokens_per_forward": t["max_tokens_per_forward"], "max_seq_len": t.get("max_seq_len")}
        backend = "nccl" if self._bundle.get("GPU") else "gloo"
        self._tokens = [m.setup.remote(address, rank, self.size, backend, t["resolved_path"], self._layers, options,
                                       bool(t["expert_parallel"]), float(t["batch_timeout_s"]))
                        for rank, m in enumerate(self._members)]

    def _lost_member(self) -> bool:
        """Whether a call in flight failed because its member died (polled without waiting)."""
        if not self._tokens:
            return False
        ready, self._tokens = ray.wait(self._tokens, num_returns=len(self._tokens), timeout=0, fetch_local=False)
        lost = False
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                lost = True
            except OutOfMemory as e:  # on any member (rank 0's reaches its trainer too): ends the run, no restart
                self._fatal = self._fatal or e
            except Exception:  # noqa: BLE001 - an error about the input: the group itself is fine
                pass
        return lost

    def _restart_if_lost(self) -> None:
        lost = self._lost_member()
        if self._fatal is not None:  # its own message, not the RayTaskError's traceback
            raise OutOfMemory(str(getattr(self._fatal, "cause", None) or self._fatal))
        if not lost:
            return
        limit = int(self._target["max_restarts"])
        if limit != -1 and self.restarts >= limit:
            raise RuntimeError(f"target group {self.index} lost a member again after {self.restarts} restarts "
                               f"(target.max_restarts={limit}); see its members' logs")
        self.restarts += 1
        log.warning("target group %d lost a member: restarting all %d members (restart %d)", self.index, self.size,
                    self.restarts)
        for m in self._members:
            ray.kill(m, no_restart=True)
        self._start()

    def _encode(self, batch_index: int, samples: list, cache: str | None = None) -> ray.ObjectRef:
        with self._lock:
            self._restart_if_lost()
            shared = ray.put(samples)  # one copy in the object store, read by every member
            outs = [m.encode.options(num_returns=2).remote(batch_index, shared, cache) for m in self._members]
            self._tokens += [done for _, done in outs]
            return outs[0][0]

    def _embedding_weights(self) -> ray.ObjectRef:
        with self._lock:
            self._restart_if_lost()
            refs = [m.embedding_weights.remote() for m in self._members]
            self._tokens += refs[1:]  # rank 0's holds the weights: not polled (it would be fetched here)
            return refs[0]

    def members(self) -> list[Any]:
        """The members' actor handles, rank order (operators and fault tests)."""
        with self._lock:
            return list(self._members)

    def kill(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            for m in self._members:
                ray.kill(m, no_restart=True)
            remove_placement_group(self._pg)
