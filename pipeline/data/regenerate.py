"""Response regeneration, the data stage's side: the target writes its own reply to each prompt, so the draft
learns the target's outputs.

This module is the contract between the data stage and whatever runs the target: `GenParams` (how to sample),
`Generation` (the exact token ids the target produced, up to and including its stop token; the data stage trains
on those ids rather than on a re-tokenized decode, so the draft sees the target's own token boundaries),
`batch_seed` and the `ReplyGenerator` callable. The model part, `generate_batch`, and the two generators (in this
process, or through TargetWorker actors) are workers/frozen_target/generation.py.

Determinism: a batch is sampled under `torch.manual_seed(seed)` inside a forked RNG, with the seed derived from
the batch's first row id. The same rows in the same batches therefore give the same tokens on the same hardware
and software, which is what makes a resumed run identical to an uninterrupted one (the data stage always forms
the same batches: the batch size is part of the run's fingerprint). With `batch_size=1` every row is seeded by its
own id and the output no longer depends on which rows share a batch; larger batches are faster (figures in
docs/data_stage.md) but a row's sample depends on its batch-mates' padding and RNG draws.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GenParams:
    temperature: float = 0.8  # 0 = greedy
    top_p: float = 0.95
    top_k: int = 0  # 0 = off (HF's own default of 50 would silently change the target's distribution)
    max_new_tokens: int = 256
    seed: int = 0
    # keep a reply cut at max_new_tokens (its tokens, no stop token appended) instead of dropping it: every token is
    # still the target's own continuation, so a draft learns from it; the cut replies are the longest ones
    keep_unfinished: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.keep_unfinished:  # absent when off: stages fingerprinted before the option resume as they were
            del d["keep_unfinished"]
        return d


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # new tokens, ending with the stop token when finished
    finished: bool  # a stop token came before max_new_tokens


def batch_seed(seed: int, row_id: str) -> int:
    """A 63-bit seed from the run seed and a row id (stable across Python processes, unlike hash())."""
    digest = hashlib.sha256(f"{seed}/{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# A generator maps [(seed, prompts)] batches to their replies, in order, or to the exception that batch raised (so
# one failing batch is counted by the data stage instead of losing the others); how it runs them is its own business.
# It may hand them over one by one as they finish (a generator function): the data stage counts its progress as it
# receives each batch, so a shard of hundreds of prompts does not sit at 0 % for ten minutes.
Batches = list[tuple[int, list[list[int]]]]
ReplyGenerator = Callable[[Batches, GenParams], Iterable[list[Generation] | Exception]]
