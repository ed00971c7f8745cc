"""The global, deterministic order in which samples become feature batches.

Batch b holds samples order_e[j*B:(j+1)*B] where e = b // batches_per_epoch, j = b % batches_per_epoch and order_e
is a seeded permutation of the dataset for epoch e. Trainer rank r of world size R, at optimizer step s and
micro-step m of A, consumes batch b = (s*A + m)*R + r. Both are pure functions of their arguments, so a resumed run
that knows only its step consumes exactly the batches the uninterrupted run would have: none repeated, none skipped.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def batches_per_epoch(num_samples: int, samples_per_batch: int) -> int:
    return -(-num_samples // samples_per_batch)


def batch_sample_ids(batch_index: int, num_samples: int, samples_per_batch: int, seed: int) -> list[int]:
    if batch_index < 0:
        raise ValueError(f"batch index must be >= 0, got {batch_index}")
    per_epoch = batches_per_epoch(num_samples, samples_per_batch)
    epoch, j = divmod(batch_index, per_epoch)
    return epoch_order(num_samples, seed, epoch)[j * samples_per_batch:(j + 1) * samples_per_batch].tolist()


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The seeded permutation of epoch `epoch` (read-only). Cached: every batch of an epoch slices the same one, so
    a batch costs its own size, not a permutation of the whole data set (a ledger audit over many batches
    would otherwise grow as batches x samples)."""
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    order.flags.writeable = False
    return order


def batch_index_for(step: int, micro: int, rank: int, grad_accum: int, world_size: int) -> int:
    return (step * grad_accum + micro) * world_size + rank
