"""A reduced draft vocabulary for the engine export: the draft's logits over the N target tokens its training
replies use most, instead of the whole target vocabulary.

Why: a DSpark draft shares the target's LM head, and on a small target that head (V rows, for every slot of
every block) is most of what the draft costs a round; a few thousand rows cover nearly every reply token. What it
saves in llama.cpp, and what it costs in acceptance: docs/design-notes.md, "A reduced draft vocabulary".

What is written (deepspec schema, as llama.cpp's converter reads it, class DSparkModel): `draft_vocab_size` N in
config.json, `lm_head.weight` [N, D] (the target's LM-head rows of the chosen tokens), `d2t` [N] int64 in the
EAGLE-3 convention (target id − draft index; the converter turns it into absolute ids), and the Markov head's
`markov_w2` rows of the chosen tokens ([N, r]; `markov_w1`, indexed by the previous token, keeps every row).
Nothing is approximated: the draft's logits over the chosen tokens are exactly its full-vocabulary logits there.
Greedy drafting changes only where the full argmax falls outside the set, where the target rarely agrees anyway.

Legend: V target vocabulary, N draft vocabulary, D hidden size, r Markov rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from serving._io import safetensors_weight_map

D2T = "d2t"
LM_HEAD = "lm_head.weight"
MARKOV_W2 = "markov_head.markov_w2.weight"


def reply_token_counts(data: str | os.PathLike, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each token id is a loss-masked (reply) token in a data-stage source."""
    from pipeline.data.parquet_source import ParquetSamples

    counts_V = np.zeros(vocab_size, dtype=np.int64)
    for _, ids, mask in ParquetSamples(data).chunks():
        reply = ids[mask]
        if len(reply) and int(reply.max()) >= vocab_size:
            raise ValueError(f"data {data}: token id {int(reply.max())} is outside the target's vocabulary "
                             f"({vocab_size}); was it tokenized for another target?")
        counts_V += np.bincount(reply, minlength=vocab_size)
    if not counts_V.any():
        raise ValueError(f"data {data} has no loss-masked tokens to choose a draft vocabulary from")
    return counts_V


def choose_draft_vocab(counts_V: np.ndarray, size: int) -> torch.Tensor:
    """int64 [N] ascending target ids: the `size` most frequent; ties, and the ids never seen when fewer than
    `size` were, go to the lowest id (a BPE's low ids are its earliest, most frequent merges)."""
    vocab_size = len(counts_V)
    if not 0 < size <= vocab_size:
        raise ValueError(f"--draft-vocab {size}: must be between 1 and the target's vocabulary size {vocab_size}")
    order = np.lexsort((np.arange(vocab_size), -counts_V))  # count descending, then id ascending
    return torch.from_numpy(np.sort(order[:size]).astype(np.int64))


def target_lm_head(target_dir: str | os.PathLike) -> torch.Tensor:
    """[V, D] the target's LM-head weight from its safetensors (one file or an index of shards); the input
    embedding where the target ties the two (no lm_head tensor)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    where = safetensors_weight_map(target_dir)
    if not where:
        raise FileNotFoundError(f"target {target_dir} has no safetensors weights (the LM head of a reduced draft "
                                "vocabulary is read from them)")
    for name in ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"):
        if name in where:
            with safe_open(str(target_dir / where[name]), "pt") as f:
                return f.get_tensor(name)
    raise KeyError(f"target {target_dir}: no lm_head.weight or embed_tokens.weight in its safetensors")


def draft_vocab_from_data(target_dir: str | os.PathLike, data: str | os.PathLike, size: int
                          ) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(ids_N, lm_head_VD, a line saying what the vocabulary covers) for `write_engine_export(draft_vocab=...)`:
    the `size` commonest reply tokens of the data stage `data` and the LM head of the target in `target_dir`."""
    lm_head_VD = target_lm_head(target_dir)
    counts_V = reply_token_counts(data, lm_head_VD.shape[0])
    ids_N = choose_draft_vocab(counts_V, size)
    covered = counts_V[ids_N.numpy()].sum() / counts_V.sum()
    return ids_N, lm_head_VD, (f"the {size} commonest of the {int((counts_V > 0).sum())} distinct reply tokens of "
                               f"{data} ({covered:.2%} of them)")


def reduce_vocab(tensors: dict[str, torch.Tensor], ids_N: torch.Tensor, lm_head_VD: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """The engine tensors of a full-vocabulary draft (serving/engine_export.engine_tensors) with the draft
    vocabulary `ids_N` (choose_draft_vocab): its own LM head, d2t, and the Markov W2 rows of those tokens."""
    vocab_size = lm_head_VD.shape[0]
    out = dict(tensors)
    out[LM_HEAD] = lm_head_VD[ids_N].to(torch.float32).contiguous()
    out[D2T] = (ids_N - torch.arange(len(ids_N))).to(torch.int64)
    if MARKOV_W2 in out:
        w2_VR = out[MARKOV_W2]
        assert w2_VR.shape[0] == vocab_size, (w2_VR.shape, vocab_size)
        out[MARKOV_W2] = w2_VR[ids_N].contiguous()
    return out
