"""Out of GPU memory is a fatal, one-line error, on the trainers and on the target alike.

A CUDA out-of-memory error repeats exactly when the same batch is run again: the shapes are functions of the
config and of the batch index. Left as it is, Ray Train rebuilds the trainer group `cluster.max_failures` times and a
target group reloads its model up to `target.max_restarts` times before the run fails, each time at the same
allocation. `OutOfMemory` is what both raise instead: it is in the trainers' FATAL_ERRORS
(workers/trainer/ray_trainer.py), a target group member raises it as a task error, never as a lost member
(workers/frozen_target/group.py), and the driver prints its one line as `error: training failed: ...` (exit 1).

Run: python -m pytest -q tests/test_gpu_correctness.py
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class OutOfMemory(RuntimeError):
    """Out of GPU memory at a shape the config sets; the message names the rank, the shape and the key to lower."""


def first_line(e: BaseException) -> str:
    """torch's own OOM text, first line (it names how much it tried to allocate and what was free)."""
    return (str(e).strip().splitlines() or [""])[0]


@contextmanager
def out_of_memory_is_fatal(describe, *args) -> Iterator[None]:
    """Turn a `torch.OutOfMemoryError` raised inside the block into `OutOfMemory(describe(e, *args))` (no chain, so
    the one line is all a log shows)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(describe(e, *args)) from None


def _batch_keys(cfg) -> list[str]:
    """The keys that shrink a trainer's micro-batches (and, unset, activation checkpointing)."""
    keys = [f"data.anchors_per_seq ({cfg.data.anchors_per_seq}: blocks per sequence)",
            f"data.samples_per_batch ({cfg.data.samples_per_batch}: sequences per micro-batch)"]
    if not cfg.train.activation_checkpointing:
        keys.append("or set train.activation_checkpointing=true")
    return keys


def trainer_step_oom(e: BaseException, rank: int, step: int, micro: list, cfg) -> str:
    """The trainer's line: which rank, the (blocks, tokens) of each micro-batch it held, and the keys that shrink
    them (and train.activation_checkpointing=true when it is off)."""
    shapes = ", ".join(f"({mb.batch.valid_NK.shape[0]} blocks, {mb.batch.input_ids_T.shape[0]} tokens)"
                       for mb in micro)
    return (f"trainer rank {rank} ran out of GPU memory in step {step} on micro-batches of {shapes} "
            f"({first_line(e)}); lower {', '.join(_batch_keys(cfg))}")


def trainer_fetch_oom(e: BaseException, rank: int, step: int, cfg) -> str:
    """The trainer's line for its prefetch thread (workers/trainer/prefetch.py), which copies a step's micro-batches
    to the device and decodes their features there: which rank, which step's batches, the keys that shrink them."""
    return (f"trainer rank {rank} ran out of GPU memory fetching step {step}'s micro-batches (copying them to the "
            f"device and decoding their features) ({first_line(e)}); lower {', '.join(_batch_keys(cfg)[:2])}")


def target_forward_oom(e: BaseException, rank: int, batch_index: int, shape_BL: tuple[int, int],
                       max_tokens_per_forward: int) -> str:
    """The target's line: which rank, the forward's shape and tokens, and target.max_tokens_per_forward."""
    b, length = shape_BL
    return (f"target rank {rank} ran out of GPU memory encoding batch {batch_index} in a forward of {b} x {length} "
            f"= {b * length} tokens ({first_line(e)}); lower target.max_tokens_per_forward (now "
            f"{max_tokens_per_forward}) or give the target more GPUs (target.tp_size)")
