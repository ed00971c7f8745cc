"""The mask token of a `draft.mask=token` draft: a target token id whose frozen embedding row fills the block's
mask slots, the form the serving engines read (`mask_token_id` in their draft configs).

The id must never appear where the draft reads real tokens, or a real token would look like "not yet drafted":
not in the training data, not in what the chat template writes, not a token the target ends or pads with.
`choose_mask_token` picks the lowest added (special) token of the tokenizer that none of those use;
`check_mask_token` refuses an id the data or the template holds. Both run at launch, before any worker starts
(workers/inputs.py); the chosen id is saved in the run's config, so a resume and the export keep it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

# a conversation with every role the chat renderer writes (pipeline/data/chat.py)
_PROBE_CHAT = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
               {"role": "assistant", "content": "a"}]


def template_ids(tokenizer) -> set[int]:
    """Ids the tokenizer's chat template writes around messages, plus its bos/eos/pad/unk tokens."""
    ids = {i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
                       tokenizer.unk_token_id) if i is not None}
    if getattr(tokenizer, "chat_template", None):
        for chat in (_PROBE_CHAT, _PROBE_CHAT[1:]):  # some templates refuse a system turn
            try:
                out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            except Exception:  # noqa: BLE001 (a template may raise anything on a role it does not know)
                continue
            ids.update(int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out))
    return ids


def choose_mask_token(tokenizer) -> int:
    """The lowest added token id (the tokenizer's special/control tokens) that the chat template and the
    tokenizer's own bos/eos/pad/unk never use. ValueError if there is none."""
    used = template_ids(tokenizer)
    added = sorted(int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}))
    for token_id in added:
        if token_id not in used:
            return token_id
    raise ValueError("the target's tokenizer has no added token that its chat template does not use; set "
                     "draft.mask_token_id to a token id the data never holds")


def first_sample_holding(token_id: int, samples: Iterable, chunk: int = 8192) -> int | None:
    """Index of the first sample whose input_ids hold `token_id`, or None. Vectorised: the ids of `chunk` samples
    at a time are joined into one array and compared at once (a loop of one comparison per sample took seconds per
    million samples); the chunk bounds the copy to a few MB whatever the data set's size."""
    rows, start = iter(samples), 0  # a list, or a source that streams its rows (pipeline/data/parquet_source.py)
    while ids := [s.input_ids for s in itertools.islice(rows, chunk)]:
        hit = np.flatnonzero(np.concatenate(ids) == token_id)
        if len(hit):
            ends = np.cumsum([len(x) for x in ids])
            return start + int(np.searchsorted(ends, hit[0], side="right"))
        start += len(ids)
    return None


def check_mask_token(token_id: int, tokenizer, samples: Sequence) -> None:
    """ValueError naming the reason when `token_id` is written by the chat template or held by a sample."""
    if token_id in template_ids(tokenizer):
        raise ValueError(f"draft.mask_token_id={token_id} ({tokenizer.convert_ids_to_tokens(token_id)!r}) is a token "
                         "the chat template or the tokenizer's bos/eos/pad writes; choose another id, or -1 to "
                         "choose automatically")
    if hasattr(samples, "holds_token") and not samples.holds_token(token_id):
        return  # a scanned source (pipeline/data/parquet_source.py) knows its token ids: no pass over the samples
    i = first_sample_holding(token_id, samples)
    if i is not None:
        raise ValueError(f"draft.mask_token_id={token_id} occurs in training sample {i}: the mask slot would "
                         "look like a real token; choose another id, or -1 to choose automatically")
