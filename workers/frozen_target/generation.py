"""Reply generation on the target, the model's side of the data stage's regeneration (pipeline/data/regenerate.py).

`generate_batch` runs Hugging Face `generate` on one batch of already-rendered prompts (left padding, so every
prompt ends at the same position and generation starts together) and returns the exact token ids the target
produced, up to and including its stop token, sampled under the batch's seed in a forked RNG.

Where generation runs: `LocalGenerator` in this process (tests, single machine), `RayGenerator` through
TargetWorker actors (workers/frozen_target/worker.py), one batch per actor call, batches spread over the actors.

Legend (shape suffixes): B prompts in the batch, L longest prompt, N new tokens generated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pipeline.data.regenerate import Batches, Generation, GenParams
from workers.frozen_target.model import stop_token_ids


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[int]], params: GenParams, seed: int) -> list[Generation]:
    """Sample one reply per prompt (token ids of the rendered conversation, ending with the generation prompt)."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("generate_batch needs at least one prompt and no empty prompt")
    stops = stop_token_ids(model, tokenizer)
    if not stops:
        raise ValueError("the target has no eos token (neither generation_config.eos_token_id nor "
                         "tokenizer.eos_token_id): a reply could never be seen to finish")
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


class LocalGenerator:
    """Runs the batches one after another on a model held in this process."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def __call__(self, batches: Batches, params: GenParams) -> Iterator[list[Generation] | Exception]:
        for seed, prompts in batches:
            try:
                yield generate_batch(self.model, self.tokenizer, prompts, params, seed)
            except Exception as e:  # counted per row by the caller; a systematic failure is raised there
                yield e


class RayGenerator:
    """Spreads the batches over TargetWorker actors (round robin), all submitted at once, and hands the replies over
    in batch order as they arrive."""

    def __init__(self, actors: list):
        if not actors:
            raise ValueError("RayGenerator needs at least one target worker actor")
        self.actors = actors

    def __call__(self, batches: Batches, params: GenParams) -> Iterator[list[Generation] | Exception]:
        # submitted here, before the first reply is awaited, so every actor has work while the caller iterates
        refs = [self.actors[i % len(self.actors)].generate.remote(prompts, params, seed)
                for i, (seed, prompts) in enumerate(batches)]
        return self._collect(refs)

    @staticmethod
    def _collect(refs: list) -> Iterator[list[Generation] | Exception]:
        import ray

        for ref in refs:
            try:
                yield ray.get(ref)
            except Exception as e:  # RayTaskError / RayActorError: counted per row by the caller
                yield e
