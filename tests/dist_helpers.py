"""Run a function on R local ranks joined by a gloo process group (not a test module).

`run_ranks(fn, world, *args)` spawns `world` processes, each with RANK/WORLD_SIZE/MASTER_* set and
`torch.distributed` initialised over gloo (what DeepSpeed uses on CPU), calls `fn(rank, world, *args)` and
returns the results in rank order. `fn` must be importable (a module-level function). Every process is joined,
or killed by its own handle, before this returns.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from typing import Any

from launch_helpers import free_port


def _entry(fn, rank: int, world: int, port: int, out, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # plain pickle, by value: torch's queue pickler would share tensors through file descriptors that die
        # with this process
        out.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args: Any, timeout: float = 600) -> list[Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = out.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    except queue.Empty:
        raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave no result in {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]
