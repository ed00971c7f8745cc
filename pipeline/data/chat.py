"""Chat rendering: a conversation -> token ids + a loss mask that is True on what the assistant says.

The mask is derived from the tokenizer's own chat template, not from hard-coded markers: for each assistant turn
i, rendering messages[:i] with the generation prompt gives the character where the turn's content may start and
rendering messages[:i+1] gives where the turn ends. Tokens of the full rendering whose character span overlaps
the assistant's content are trained on, plus the one token right after the content (the template's
end-of-turn marker, e.g. ChatML's <|im_end|>), so the draft learns to propose the end of a reply. Anything else
the template puts in the turn (role headers, the newline after <|im_end|>) is not trained on.
"""

from __future__ import annotations

import functools

import numpy as np

# chars of text per token kept before tokenizing, over the longest token's length: a normalizer that drops
# characters (control characters, accents) needs more text per token than the vocabulary shows
BUDGET_SAFETY = 2
BUDGET_SPARE_TOKENS = 16  # the tokenization of a cut text may differ from the whole text's in its last tokens


@functools.lru_cache(maxsize=8)
def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters. Entries are written at least as long as the text they stand for
    (byte-level BPE writes one character per byte, SentencePiece a marker per space), so no token covers more."""
    return max(len(t) for t in tokenizer.get_vocab())


def char_budget(tokenizer, max_len: int) -> int:
    """How many characters of one text can matter to its first `max_len` tokens: cutting a text (or a message's
    content) to this many characters before tokenizing leaves those tokens as they are, so a 2 GB record costs
    no more to tokenize than one of this length."""
    return (max_len + BUDGET_SPARE_TOKENS) * max_token_chars(tokenizer) * BUDGET_SAFETY


def render_text(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """The tokenizer's chat template applied to `messages`, as text: the one rendering of the project (the data
    stage's rows and masks, the regeneration prompts and the evaluator's chat prompts all go through it)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_prompt(tokenizer, prompt: list[dict]) -> list[int]:
    """Token ids the target sees before writing its reply (the template's generation prompt included)."""
    return list(tokenizer(render_text(tokenizer, prompt, True), add_special_tokens=False)["input_ids"])


def render_chat(tokenizer, messages: list[dict], sample_name: str = "<unnamed>") -> tuple[np.ndarray, np.ndarray]:
    """Render `messages` ([{"role", "content"}, ...]) with the chat template: (input_ids int64 [L], loss_mask bool
    [L]). Raises ValueError naming `sample_name` when a turn is malformed, an assistant turn is empty, or the
    template leaves nothing to train on."""
    if not messages:
        raise ValueError(f"sample {sample_name}: conversation has no messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"sample {sample_name}: message {j} must be a dict with string 'role' and 'content'")
    full = render_text(tokenizer, messages, add_generation_prompt=False)

    spans: list[tuple[int, int, int]] = []  # (content_start, content_end, turn_end) in characters of `full`
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not m["content"].strip():
            raise ValueError(f"sample {sample_name}: assistant turn {i} is empty")
        start = len(render_text(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
        end_text = render_text(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not full.startswith(end_text):
            raise ValueError(f"sample {sample_name}: the chat template does not render turn {i} as a prefix of "
                             "the whole conversation; cannot locate the assistant tokens")
        # Templates may trim or re-wrap content, so look for it inside this turn instead of assuming an offset;
        # untrimmed first, so that trailing whitespace the template keeps is trained on and the next token is
        # really the end-of-turn marker.
        content = m["content"]
        found = full.find(content, start, len(end_text))
        if found < 0:
            content = content.strip()
            found = full.find(content, start, len(end_text))
        if found < 0:
            raise ValueError(f"sample {sample_name}: assistant turn {i}'s content does not appear verbatim in "
                             "the rendered template")
        spans.append((found, found + len(content), len(end_text)))

    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    a, b = off[:, 0], off[:, 1]
    mask = np.zeros(len(ids), dtype=bool)
    for c0, c1, turn_end in spans:
        hit = np.nonzero((a < c1) & (b > c0) & (b > a))[0]
        if hit.size == 0:
            continue
        mask[hit] = True
        eot = hit[-1] + 1
        if eot < len(ids) and a[eot] < turn_end:
            mask[eot] = True  # the end-of-turn marker
    if not mask.any():
        raise ValueError(f"sample {sample_name}: the chat template marks no assistant tokens to train on "
                         f"(roles: {[m['role'] for m in messages]})")
    return ids, mask
