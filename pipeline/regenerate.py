"""Response regeneration: the target writes its own reply to each prompt, so the draft learns the target's outputs.

`generate_batch` runs Hugging Face `generate` on one batch of already-rendered prompts (left padding, so every
prompt ends at the same position and generation starts together). It returns the exact token ids the target
produced, up to and including its stop token; the data stage trains on those ids rather than on a re-tokenized
decode, so the draft sees the target's own token boundaries.

Determinism: a batch is sampled under `torch.manual_seed(seed)` inside a forked RNG, with the seed derived from
the batch's first row id. The same rows in the same batches therefore give the same tokens on the same hardware
and software, which is what makes a resumed run identical to an uninterrupted one (the data stage always forms
the same batches: the batch size is part of the run's fingerprint). With `batch_size=1` every row is seeded by its
own id and the output no longer depends on which rows share a batch; larger batches are faster (figures in
docs/data_stage.md) but a row's sample depends on its batch-mates' padding and RNG draws.

Where generation runs: `LocalGenerator` in this process (tests, single machine), `RayGenerator` through
TargetWorker actors (workers/target/worker.py), one batch per actor call, batches spread over the actors.

Legend (shape suffixes): B prompts in the batch, L longest prompt, N new tokens generated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class GenParams:
    temperature: float = 0.8  # 0 = greedy
    top_p: float = 0.95
    top_k: int = 0  # 0 = off (HF's own default of 50 would silently change the target's distribution)
    max_new_tokens: int = 256
    seed: int = 0

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
        return asdict(self)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # new tokens, ending with the stop token when finished
    finished: bool  # a stop token came before max_new_tokens


def batch_seed(seed: int, row_id: str) -> int:
    """A 63-bit seed from the run seed and a row id (stable across Python processes, unlike hash())."""
    digest = hashlib.sha256(f"{seed}/{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def stop_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a reply: the model's generation config (chat models often list several) + the
    tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the target has no eos token (neither generation_config.eos_token_id nor "
                         "tokenizer.eos_token_id): a reply could never be seen to finish")
    return sorted(set(int(i) for i in ids))


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[int]], params: GenParams, seed: int) -> list[Generation]:
    """Sample one reply per prompt (token ids of the rendered conversation, ending with the generation prompt)."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate_batch needs at least one prompt and no empty prompt")
    stops = stop_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    device = model.get_input_embeddings().weight.device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids_BL = torch.full((B, L), pad, dtype=torch.long)
    mask_BL = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids_BL[b, L - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask_BL[b, L - len(p):] = 1
    sampling = params.temperature > 0
    # Explicit None for the sampling knobs under greedy, so the model's generation_config cannot re-enable them.
    knobs = (dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
             if sampling else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out_BX = model.generate(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device),
                                max_new_tokens=params.max_new_tokens, eos_token_id=stops, pad_token_id=pad,
                                **knobs)
    new_BN = out_BX[:, L:].cpu()
    is_stop_BN = torch.isin(new_BN, torch.tensor(stops))
    results = []
    for b in range(B):
        hit = is_stop_BN[b].nonzero()
        if hit.numel():
            results.append(Generation(new_BN[b, :int(hit[0]) + 1].tolist(), True))
        else:
            results.append(Generation(new_BN[b].tolist(), False))
    return results


# A generator maps [(seed, prompts)] batches to their replies, in order, or to the exception that batch raised (so
# one failing batch is counted by the data stage instead of losing the others); how it runs them is its own business.
Batches = list[tuple[int, list[list[int]]]]
Generator = Callable[[Batches, GenParams], list[list[Generation] | Exception]]


class LocalGenerator:
    """Runs the batches one after another on a model held in this process."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def __call__(self, batches: Batches, params: GenParams) -> list[list[Generation] | Exception]:
        out: list[list[Generation] | Exception] = []
        for seed, prompts in batches:
            try:
                out.append(generate_batch(self.model, self.tokenizer, prompts, params, seed))
            except Exception as e:  # counted per row by the caller; a systematic failure is raised there
                out.append(e)
        return out


class RayGenerator:
    """Spreads the batches over TargetWorker actors (round robin) and waits for all of them."""

    def __init__(self, actors: list):
        if not actors:
            raise ValueError("RayGenerator needs at least one target worker actor")
        self.actors = actors

    def __call__(self, batches: Batches, params: GenParams) -> list[list[Generation] | Exception]:
        import ray

        refs = [self.actors[i % len(self.actors)].generate.remote(prompts, params, seed)
                for i, (seed, prompts) in enumerate(batches)]
        out: list[list[Generation] | Exception] = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except Exception as e:  # RayTaskError / RayActorError: counted per row by the caller
                out.append(e)
        return out
