"""Offline speculative-decoding evaluator: datasets of prompts -> decoding metrics per drafter.

Decoding itself is evaluation.session.generate (real target with a KV cache, a Drafter from
evaluation.drafters). Metrics per dataset: mean τ, per-position conditional acceptance (denominator = rounds in
which positions 1..k−1 were all accepted), target forwards (prefills + rounds), wall time, tokens/s, and — when
the drafter reports confidences — ECE and ROC-AUC of c_k against acceptance at every reached position. τ is
counted from the verifier's outcome of every round, also the last one whose tokens may be cut at
max_new_tokens/EOS.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from draft_model.sampling import ACCEPTED, NOT_REACHED
from evaluation.drafters import Drafter
from evaluation.progress import EvalProgress
from evaluation.session import RoundLog, generate, sync
from pipeline.data.chat import render_prompt
from serving.metrics import expected_calibration_error, roc_auc
from workers.frozen_target.model import stop_token_ids

__all__ = ["encode_prompt", "evaluate", "evaluate_many"]


def encode_prompt(tokenizer, prompt: str | list[dict] | list[int]) -> list[int]:
    """Token ids of a prompt: raw text, a chat (rendered with the generation prompt) or ids as they are."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer with a chat template")
        return render_prompt(tokenizer, prompt)
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("a prompt must be a string, a non-empty list of chat messages or of token ids; "
                     f"got {prompt!r:.80}")


def _dataset_metrics(rounds: RoundLog, new_tokens: int, forwards: int, wall_s: float, num_prompts: int) -> dict:
    acc_RK = torch.stack(rounds.accepted_RK).long() if rounds.accepted_RK else torch.zeros(0, 0, dtype=torch.long)
    R = acc_RK.shape[0]
    tau_R = (acc_RK == ACCEPTED).sum(1).double() + 1
    reached_K = (acc_RK != NOT_REACHED).sum(0)
    accepted_K = (acc_RK == ACCEPTED).sum(0)
    cond = [None if int(r) == 0 else float(a) / float(r) for a, r in zip(accepted_K, reached_K)]
    ece = auc = None
    conf_mean: list[float | None] = []
    if rounds.conf_RK:
        assert len(rounds.conf_RK) == R, "a drafter must give confidences in every round or in none"
        conf_RK = torch.stack(rounds.conf_RK)
        reached = acc_RK != NOT_REACHED
        c, y = conf_RK[reached].numpy(), (acc_RK[reached] == ACCEPTED).numpy()
        ece, auc = expected_calibration_error(c, y, num_bins=10), roc_auc(c, y)
        conf_mean = [float(conf_RK[reached[:, k], k].mean()) if reached[:, k].any() else None
                     for k in range(conf_RK.shape[1])]
    return {
        "num_prompts": num_prompts,
        "rounds": R,
        "new_tokens": new_tokens,
        "tau": float(tau_R.mean()) if R else math.nan,
        "tau_sem": float(tau_R.std() / math.sqrt(R)) if R > 1 else math.nan,
        "cond_acceptance": cond,
        "reached": reached_K.tolist(),
        "target_forwards": forwards,
        "tokens_per_forward": new_tokens / forwards if forwards else math.nan,
        "wall_s": wall_s,
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else math.nan,
        "draft_s_median": float(np.median(rounds.draft_s_R)) if rounds.draft_s_R else math.nan,
        "ece": ece,
        "roc_auc": auc,
        "conf_mean": conf_mean,
    }


def evaluate(target: nn.Module, tokenizer, drafter: Drafter, prompts: dict[str, list], temperature: float,
             max_new_tokens: int, seed: int = 0, eos_token_ids: Iterable[int] | None = None) -> dict:
    """Speculative decoding of every prompt of every dataset; returns the metrics (see the module docstring).

    prompts: dataset name -> prompts (text, chat messages or token ids). Each prompt gets its own generator
    seeded from (seed, dataset, index), so results do not depend on dataset order. eos_token_ids: None = the
    target's stop tokens (workers.frozen_target.model.stop_token_ids: its generation config's and its tokenizer's eos,
    the rule the data stage's replies ended by); an empty list disables stopping at EOS.
    """
    return evaluate_many(target, tokenizer, [drafter], prompts, temperature, max_new_tokens, seed, eos_token_ids)[0]


def evaluate_many(target: nn.Module, tokenizer, drafters: list[Drafter], prompts: dict[str, list],
                  temperature: float, max_new_tokens: int, seed: int = 0,
                  eos_token_ids: Iterable[int] | None = None, deadline_s: float | None = None,
                  progress: EvalProgress | None = None) -> list[dict]:
    """`evaluate` for several drafters on the same prompts, one result per drafter.

    Prompt i of every dataset runs for every drafter before prompt i + 1 of any, each with the same seed, so a
    time limit (`deadline_s`, a time.monotonic() value: no prompt index is started after it) leaves every drafter
    with the same prompts, as many from each dataset. Each result's num_prompts says how many ran.

    `progress` (evaluation/progress.py) is told after every decoded prompt.

    A result is a JSON-able dict except for "rounds": dataset -> RoundLog (per-round records; written to
    rounds.parquet by evaluation.rounds.write_rounds, left out of the report and of cached results).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos_ids = set(stop_token_ids(target, tokenizer) if eos_token_ids is None else eos_token_ids)
    device = target.get_output_embeddings().weight.device
    outs = [{"drafter": d.name, "gamma": d.block_size, "temperature": temperature, "max_new_tokens": max_new_tokens,
             "seed": seed, "sts_temperatures": getattr(d, "sts_temperatures", None), "datasets": {}, "generations": {},
             "rounds": {}} for d in drafters]
    state = {(j, ds): {"rounds": RoundLog(), "gens": [], "forwards": 0, "new": 0, "wall": 0.0}
             for j in range(len(drafters)) for ds in prompts}
    for i in range(max((len(v) for v in prompts.values()), default=0)):
        if deadline_s is not None and time.monotonic() >= deadline_s:
            break
        for ds, items in prompts.items():
            if i >= len(items):
                continue
            ids = encode_prompt(tokenizer, items[i])
            entropy = [seed, zlib.crc32(ds.encode()), i]
            prompt_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
            for j, drafter in enumerate(drafters):
                st = state[(j, ds)]
                g = torch.Generator(device=device).manual_seed(prompt_seed)
                sync(device)
                t0 = time.perf_counter()
                before = len(st["rounds"].num_accepted_R)
                new, fwd = generate(target, drafter, ids, temperature, max_new_tokens, g, eos_ids, st["rounds"], i)
                sync(device)
                seconds = time.perf_counter() - t0
                st["wall"] += seconds
                if progress is not None:
                    accepted_R = st["rounds"].num_accepted_R[before:]
                    progress.update(len(accepted_R), sum(accepted_R), len(new), seconds)
                st["forwards"] += fwd
                st["new"] += len(new)
                st["gens"].append({"prompt_tokens": len(ids), "tokens": new})
    for j, out in enumerate(outs):
        for ds in prompts:
            st = state[(j, ds)]
            for gen in st["gens"]:
                gen["text"] = tokenizer.decode(gen["tokens"]) if tokenizer is not None else None
            out["datasets"][ds] = _dataset_metrics(st["rounds"], st["new"], st["forwards"], st["wall"],
                                                   len(st["gens"]))
            out["generations"][ds] = st["gens"]
            out["rounds"][ds] = st["rounds"]
    return outs
