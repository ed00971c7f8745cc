"""Chat rendering + loss masks (golden, real SmolLM2 ChatML tokenizer), the stdlib default corpus, JSONL loading.

Run: python -m pytest tests/test_corpus.py -q
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from pipeline.data.chat import render_chat
from pipeline.data.corpus import default_corpus, load_jsonl_corpus, stdlib_files
from workers.frozen_target.model import smollm2_tokenizer

CONVERSATION = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "2+3 = 5."},
                {"role": "user", "content": "And times 4?"}, {"role": "assistant", "content": "20"}]
# The SmolLM2 template inserts its default system prompt (ids 1 .. 198 at index 20) before the first turn.
GOLDEN_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 35, 47, 2, 198, 1, 520, 9531, 198, 34, 27, 35, 446,
              216, 37, 30, 2, 198, 1, 4093, 198, 3528, 1711, 216, 36, 47, 2, 198, 1, 520, 9531, 198, 34, 32, 2, 198]
GOLDEN_MASKED = list(range(37, 45)) + [60, 61, 62]  # "2+3 = 5." <|im_end|>, "20" <|im_end|>
IM_END = 2


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_render_chat_golden(tok):
    ids, mask = render_chat(tok, CONVERSATION)
    assert ids.dtype == np.int64 and mask.dtype == bool
    assert ids.tolist() == GOLDEN_IDS
    assert np.nonzero(mask)[0].tolist() == GOLDEN_MASKED
    assert tok.decode(ids[37:44]) == "2+3 = 5." and tok.decode(ids[60:62]) == "20"
    assert ids[44] == IM_END and ids[62] == IM_END and ids[63] == 198 and not mask[63]
    # Same ids as the template's own tokenization.
    assert ids.tolist() == list(tok.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])


def test_render_chat_system_and_multiline(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Code?"},
            {"role": "assistant", "content": "def f():\n    return 1\n"}]
    ids, mask = render_chat(tok, msgs)
    # The trailing newline the template keeps is part of the reply; the token after it is <|im_end|>.
    assert tok.decode(ids[mask]) == "def f():\n    return 1\n<|im_end|>"
    assert "helpful AI assistant" not in tok.decode(ids), "an explicit system prompt replaces the default one"


def test_render_chat_errors_name_the_sample(tok):
    with pytest.raises(ValueError, match="sample s7: assistant turn 1 is empty"):
        render_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}], "s7")
    with pytest.raises(ValueError, match="sample s8: the chat template marks no assistant tokens"):
        render_chat(tok, [{"role": "user", "content": "hi"}], "s8")
    with pytest.raises(ValueError, match="sample s9: message 0 must be a dict"):
        render_chat(tok, [{"role": "user"}], "s9")


def test_stdlib_files_sorted_without_tests():
    files = stdlib_files()
    assert len(files) > 300
    rel = [f.as_posix() for f in files]
    assert not any("/test/" in f or "/tests/" in f or "site-packages" in f or "_sysconfigdata" in f for f in rel)
    assert any(f.endswith("/json/decoder.py") for f in rel)


def test_default_corpus_deterministic_mixed_and_bounded(tok):
    a = default_corpus(tok, max_len=128, num_samples=120, seed=3)
    b = default_corpus(tok, max_len=128, num_samples=120, seed=3)
    c = default_corpus(tok, max_len=128, num_samples=120, seed=4)
    assert [s.sample_id for s in a] == list(range(120))
    assert all(np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
               for x, y in zip(a, b))
    assert not all(np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, c))
    lengths = [len(s.input_ids) for s in a]
    assert 16 <= min(lengths) and max(lengths) <= 128 and len(set(lengths)) > 30
    plain = [s for s in a if not s.loss_mask[0] and s.loss_mask[1:].all()]
    chat = [s for s in a if s.input_ids[0] == 1 and not s.loss_mask[1:].all()]
    assert len(plain) + len(chat) == 120 and 10 <= len(chat) <= 60  # chat_fraction 0.25
    for s in chat:
        reply = tok.decode(s.input_ids[s.loss_mask])
        assert reply.endswith("<|im_end|>") and "<|im_start|>" not in reply
        assert s.input_ids[-1] == 198 and s.input_ids[-2] == IM_END  # never truncated mid-reply
    # Plain samples are real Python source.
    assert sum(("def " in tok.decode(s.input_ids)) or ("import " in tok.decode(s.input_ids)) for s in plain) > 20


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_jsonl_corpus(tok, tmp_path, caplog):
    rows = [{"text": "def add(a, b):\n    return a + b\n"},
            {"messages": CONVERSATION},
            {"text": "x"},  # one token: dropped and counted
            {"text": "a longer document " * 20}]
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="pipeline.data.corpus"):
        samples = load_jsonl_corpus(path, tok, max_len=40)
    assert [s.sample_id for s in samples] == [0, 1, 2]
    text_ids = tok(rows[0]["text"], add_special_tokens=False)["input_ids"]
    assert samples[0].input_ids.tolist() == text_ids and samples[0].loss_mask.tolist() == [False] + [True] * (
        len(text_ids) - 1)
    # The chat sample (64 tokens) is cut to 40 with its mask: the first reply starts at 37.
    assert samples[1].input_ids.tolist() == GOLDEN_IDS[:40]
    assert np.nonzero(samples[1].loss_mask)[0].tolist() == [37, 38, 39]
    assert len(samples[2].input_ids) == 40
    assert "dropped 1 samples shorter than 2 tokens" in caplog.text and "truncated 2" in caplog.text


def test_load_jsonl_corpus_errors(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="dataset .*empty.jsonl has no samples"):
        load_jsonl_corpus(empty, tok)
    with pytest.raises(ValueError, match="has no samples left"):
        load_jsonl_corpus(_write_jsonl(tmp_path / "short.jsonl", [{"text": "x"}]), tok)
    with pytest.raises(ValueError, match="'text' or a 'messages' field"):
        load_jsonl_corpus(_write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x"}]), tok)
    with pytest.raises(ValueError, match="bad2.jsonl:1: assistant turn 1 is empty"):
        load_jsonl_corpus(_write_jsonl(tmp_path / "bad2.jsonl", [{"messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}]), tok)
    with pytest.raises(FileNotFoundError):
        load_jsonl_corpus(tmp_path / "missing.jsonl", tok)


def test_a_huge_record_is_cut_before_tokenizing_with_the_same_tokens(tok, tmp_path, monkeypatch):
    """A text far over the character budget gives exactly the first max_len tokens of the whole text, and the
    tokenizer never sees more than the budget (a 20 MB record: no 20 MB tokenization)."""
    from pipeline.data.chat import char_budget

    max_len = 64
    budget = char_budget(tok, max_len)
    words = " ".join(f"w{i % 997}" for i in range(2 * budget // 4))  # ~2x the budget, cheap to tokenize whole
    reply = "x = 1\n" * (budget // 3)
    path = _write_jsonl(tmp_path / "big.jsonl", [{"text": words}, {"messages": [
        {"role": "user", "content": "print it"}, {"role": "assistant", "content": reply}]}])
    samples = load_jsonl_corpus(path, tok, max_len=max_len)
    assert samples[0].input_ids.tolist() == tok(words, add_special_tokens=False)["input_ids"][:max_len]
    whole_ids, whole_mask = render_chat(tok, [{"role": "user", "content": "print it"},
                                             {"role": "assistant", "content": reply}])
    assert samples[1].input_ids.tolist() == whole_ids[:max_len].tolist()
    assert samples[1].loss_mask.tolist() == whole_mask[:max_len].tolist()

    seen: list[int] = []
    real_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, **kw: (seen.append(len(text)),
                                                                          real_call(self, text, **kw))[1])
    path = _write_jsonl(tmp_path / "huge.jsonl", [{"text": "a" * 20_000_000}])
    assert len(load_jsonl_corpus(path, tok, max_len=max_len)[0].input_ids) == max_len
    assert max(seen) <= budget


def test_the_data_stage_drops_a_huge_row_without_rendering_it(tok, monkeypatch):
    import pipeline.data.rows as rows

    monkeypatch.setattr(rows, "render_row", lambda *a, **k: pytest.fail("rendered a row that cannot fit"))
    table, bad = rows.build_shard([{"prompt": "q", "response": "a" * 10_000_000}], 0, tok, max_len=64)
    assert len(table) == 0 and bad["too_long"] == 1
