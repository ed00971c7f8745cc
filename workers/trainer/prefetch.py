"""One step ahead: the background thread that fetches, decodes and packs step s+1's micro-batches while step s
computes, shared by both batch sources (workers/trainer/ray_trainer.FeatureServiceBatches,
workers/trainer/single_process.LocalBatches).

`make(step)` runs on one worker thread, one step at a time and in order, so its results are the ones a sequential
run makes. On CUDA the thread issues its non-blocking host-to-device copies and the decode on the default stream, the
one the step's kernels run on: they are ordered before the step that reads them without any synchronize, but the
DMA and the decode are serialized with the step's compute on the GPU. What overlaps the step is the host work only
(Ray's fetch and unpickle, packing, pinning, launching the copies). The loop (workers/trainer/loop.fit) calls
`start(s + 1)` right after `take(s)`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from workers.trainer.step import MicroBatch


class OneStepAhead:
    """A one-deep prefetch of `make(step)` on a background thread (start, take, close as loop.StepBatches)."""

    def __init__(self, make: Callable[[int], list[MicroBatch]], device: torch.device, name: str = "prefetch") -> None:
        # a new thread starts on CUDA device 0: give it the trainer's (an index-less "cuda" means the current one)
        initializer = ((lambda: torch.cuda.set_device(device.index))
                       if device.type == "cuda" and device.index is not None else None)
        self._make = make
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=initializer)
        self._pending: dict[int, Future] = {}

    def start(self, step: int) -> None:
        self._pending[step] = self._pool.submit(self._make, step)

    def take(self, step: int) -> list[MicroBatch]:
        return self._pending.pop(step).result()

    def close(self) -> None:
        """Drop what is queued; a fetch already running finishes on its thread (at most target.batch_timeout_s)
        without blocking the caller."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
