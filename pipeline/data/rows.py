"""Data stage: prompt datasets -> one training row per assistant turn -> zstd Parquet shards, resumable.

Input records (JSON lines, JSON or Parquet files via `datasets`, or a hub dataset name when online), any of:
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}     (OpenAI style)
  {"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}     (ShareGPT style)
  {"prompt": str, "response" | "completion": str (optional)}

Rows. A conversation gives one row per assistant turn: the conversation up to and including that turn, rendered
with the target tokenizer's chat template (pipeline/data/chat.py). Earlier assistant turns are context only; the loss
mask covers the last turn's reply and its end-of-turn token. With regeneration the target writes that last reply
itself (pipeline/data/regenerate.py), conditioned on the original earlier turns, and the row keeps the exact tokens
it generated; a conversation that ends on a user turn then also gives a row for the reply it asks for. Rows
longer than `max_len` tokens are dropped, never truncated (a cut reply would teach the draft a wrong ending).

Bad input is counted, not silently dropped, under these reasons (stats.json, the CLI summary, the log):
  malformed_record      fields of the wrong type, unknown roles, none of the known fields
  empty_prompt          no non-empty user message before the turn
  no_assistant_turn     (without regeneration) a conversation with no assistant turn; counted per record
  empty_assistant_turn  an assistant turn with empty content: its row and every later row of the conversation
  too_long              rendered prompt (+ reply) longer than max_len tokens
  generation_failed     the generation batch raised (a shard where every batch raised stops the run instead)
  generation_unfinished no stop token within max_new_tokens: the reply would be cut, so it is dropped (with
                        GenParams.keep_unfinished it is kept as cut, no stop token appended, and counted under
                        stats.json's `unfinished_kept` instead)
  empty_generation      the target stopped at once (whitespace-only reply)
A template that marks no assistant token at all is a configuration error and raises (render_chat).

Output directory: part-00000.parquet, ... (shard s = source records [s*shard_size, (s+1)*shard_size)), rows in
(source_index, turn_index) order; progress.json (run fingerprint, completed shards with their counts, `complete`)
and stats.json. Each shard is written to a temporary name and renamed into place before progress.json (itself
replaced atomically) names it, so a killed run loses at most the shard in progress, and a restart with the same
settings redoes exactly the unfinished shards: no row is lost or duplicated, and the output equals an
uninterrupted run's. A restart with different settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.chat import BUDGET_SAFETY, max_token_chars, render_chat, render_prompt, render_text
from pipeline.data.compressed import check_stream, data_suffix
from pipeline.data.regenerate import Generation, GenParams, ReplyGenerator, batch_seed

Progress = Callable[[int, int], None]  # (batches answered, batches in the shard)

log = logging.getLogger(__name__)

REASONS = ("malformed_record", "empty_prompt", "no_assistant_turn", "empty_assistant_turn", "too_long",
           "generation_failed", "generation_unfinished", "empty_generation")
KEPT_UNFINISHED = "unfinished_kept"  # counted beside the drops in a shard's counts, reported apart
FORMAT_VERSION = 1
SCHEMA = pa.schema([
    ("row_id", pa.string()),  # "<source_index>-<turn_index>"
    ("source_index", pa.int64()),  # record position in the input
    ("turn_index", pa.int32()),  # message position of the trained assistant turn in the conversation
    ("prompt", pa.string()),  # JSON list of the messages before the turn
    ("response", pa.string()),  # the trained reply (decoded, without the stop token, when regenerated)
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.bool_())),
    ("regenerated", pa.bool_()),
    ("generation", pa.string()),  # JSON GenParams when regenerated, else null
])
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


class BadRecord(ValueError):
    def __init__(self, reason: str):
        assert reason in REASONS, reason
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class RowSpec:
    source_index: int
    turn_index: int
    prompt: list[dict]  # messages before the trained turn
    response: str | None  # the original reply (None: the conversation ends before it)

    @property
    def row_id(self) -> str:
        return f"{self.source_index}-{self.turn_index}"


# ---- input ------------------------------------------------------------------------------------------------------


def open_prompts(inputs: list[str], split: str = "train"):
    """A `datasets.Dataset` over local .jsonl/.json/.parquet files (.jsonl.gz and .jsonl.zst too; concatenated in the
    given order) or one hub dataset name."""
    import datasets

    if not inputs:
        raise ValueError("no input given: name .jsonl/.json/.parquet files or one hub dataset")
    paths = [Path(p) for p in inputs]
    if len(inputs) == 1 and not paths[0].exists() and not paths[0].suffix:
        return datasets.load_dataset(inputs[0], split=split)  # a hub name (needs the network or its cache)
    kinds = set()
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist (or is not a file)")
        suffix = data_suffix(p)  # x.jsonl.gz, x.jsonl.zst: JSON lines (datasets decompresses them by their suffix)
        if suffix not in (".jsonl", ".json", ".parquet") or (suffix == ".parquet" and p.suffix != suffix):
            raise ValueError(f"input {p}: unknown format {p.suffix!r}; use .jsonl, .json or .parquet (JSON "
                             "compressed as .jsonl.gz or .jsonl.zst)")
        if p.stat().st_size == 0:  # datasets raises a bare StopIteration on an empty file
            raise ValueError(f"input {p} is empty")
        check_stream(p)  # a damaged compressed file stops here, naming it, not inside datasets
        kinds.add("parquet" if suffix == ".parquet" else "json")
    if len(kinds) > 1:
        raise ValueError("mix of JSON and Parquet inputs; convert them to one format first")
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in paths], split="train")


def normalize_record(record: dict) -> list[dict]:
    """A record in one of the accepted layouts -> [{"role", "content"}, ...]; raises BadRecord."""
    raw = record.get("messages") if record.get("messages") is not None else record.get("conversations")
    if raw is not None:
        if not isinstance(raw, list):
            raise BadRecord("malformed_record")
        messages = []
        for m in raw:
            if not isinstance(m, dict):
                raise BadRecord("malformed_record")
            # (datasets fills the fields of the other layout with None when a file mixes them)
            role = _ROLES.get(m.get("role") if m.get("role") is not None else m.get("from"))
            content = m.get("content") if m.get("content") is not None else m.get("value")
            if role is None or not isinstance(content, str):
                raise BadRecord("malformed_record")
            messages.append({"role": role, "content": content})
    elif isinstance(record.get("prompt"), str):
        messages = [{"role": "user", "content": record["prompt"]}]
        reply = record.get("response") if record.get("response") is not None else record.get("completion")
        if reply is not None:
            if not isinstance(reply, str):
                raise BadRecord("malformed_record")
            messages.append({"role": "assistant", "content": reply})
    else:
        raise BadRecord("malformed_record")
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        raise BadRecord("empty_prompt")
    return messages


def split_turns(source_index: int, messages: list[dict], regenerate: bool) -> tuple[list[RowSpec], Counter]:
    """One RowSpec per assistant turn (plus the reply a final user turn asks for, when regenerating)."""
    bad: Counter = Counter()
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if regenerate and messages[-1]["role"] != "assistant":
        turns.append(len(messages))
    if not turns:
        bad["no_assistant_turn"] += 1
        return [], bad
    rows = []
    for i in turns:
        prompt = messages[:i]
        if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
            bad["empty_prompt"] += 1
            continue
        if any(m["role"] == "assistant" and not m["content"].strip() for m in prompt):
            bad["empty_assistant_turn"] += 1  # an empty turn in the context: the conversation is broken from here
            continue
        response = messages[i]["content"] if i < len(messages) else None
        if not regenerate and not response.strip():
            bad["empty_assistant_turn"] += 1
            continue
        rows.append(RowSpec(source_index, i, prompt, response))
    return rows, bad


# ---- rendering --------------------------------------------------------------------------------------------------


def render_row(tokenizer, prompt: list[dict], response: str, name: str = "<row>") -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of prompt + the reply, training on the last assistant turn only."""
    messages = prompt + [{"role": "assistant", "content": response}]
    ids, mask = render_chat(tokenizer, messages, sample_name=name)
    if any(m["role"] == "assistant" for m in prompt):
        # render_chat trains on every assistant turn; keep the tokens that end after the generation prompt of
        # the last one (its content starts there, so earlier turns' tokens all end at or before it).
        head = render_text(tokenizer, prompt, True)
        full = render_text(tokenizer, messages, False)
        if not full.startswith(head):
            raise ValueError(f"sample {name}: the chat template does not render the prompt as a prefix of the "
                             "conversation; cannot tell the last assistant turn apart")
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        assert list(enc["input_ids"]) == ids.tolist(), "render_chat tokenized differently"
        ends = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)[:, 1]
        mask = mask & (ends > len(head))
        if not mask.any():
            raise ValueError(f"sample {name}: the chat template marks no token of the last assistant turn")
    return ids, mask


def surely_too_long(tokenizer, messages: list[dict], max_len: int) -> bool:
    """True when the messages' text alone must make more than `max_len` tokens (no token covers more characters
    than the longest vocabulary entry, pipeline/data/chat.max_token_chars): such a row is dropped as too_long
    without rendering it, so a huge record costs nothing to tokenize."""
    chars = sum(len(m["content"]) for m in messages)
    return chars > max_len * max_token_chars(tokenizer) * BUDGET_SAFETY


# ---- one shard --------------------------------------------------------------------------------------------------


def _row_dict(spec: RowSpec, response: str, ids, mask, params: GenParams | None) -> dict:
    return {"row_id": spec.row_id, "source_index": spec.source_index, "turn_index": spec.turn_index,
            "prompt": json.dumps(spec.prompt, ensure_ascii=False), "response": response,
            "input_ids": np.asarray(ids, dtype=np.int32), "loss_mask": np.asarray(mask, dtype=bool),
            "regenerated": params is not None, "generation": json.dumps(params.to_dict()) if params else None}


def _regenerate(specs: list[RowSpec], tokenizer, max_len: int, params: GenParams, generator: ReplyGenerator,
                batch_size: int, bad: Counter, progress: Progress | None) -> list[dict]:
    prompts, kept = [], []
    for spec in specs:
        if surely_too_long(tokenizer, spec.prompt, max_len):
            bad["too_long"] += 1
            continue
        ids = render_prompt(tokenizer, spec.prompt)
        if len(ids) >= max_len:  # no room for even one reply token
            bad["too_long"] += 1
        else:
            prompts.append(ids)
            kept.append(spec)
    # Batches follow the row order, so the same rows always share a batch (deterministic, see regenerate.py).
    starts = range(0, len(kept), batch_size)
    batches = [(batch_seed(params.seed, kept[s].row_id), prompts[s:s + batch_size]) for s in starts]
    results = []
    for result in (generator(batches, params) if batches else []):
        results.append(result)
        if progress is not None:
            progress(len(results), len(batches))
    assert len(results) == len(batches), "the generator must answer every batch"
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures and len(failures) == len(results):
        raise RuntimeError(f"every generation batch of this shard failed ({len(failures)}); the first error: "
                           f"{failures[0]!r}") from failures[0]
    rows = []
    for s, result in zip(starts, results):
        group = kept[s:s + batch_size]
        if isinstance(result, BaseException):
            log.warning("generation failed for rows %s..%s: %r", group[0].row_id, group[-1].row_id, result)
            bad["generation_failed"] += len(group)
            continue
        assert len(result) == len(group), "one generation per prompt"
        for spec, prompt_ids, gen in zip(group, prompts[s:s + batch_size], result):
            row = _generated_row(spec, prompt_ids, gen, tokenizer, max_len, params, bad)
            if row is not None:
                rows.append(row)
    return rows


def _generated_row(spec: RowSpec, prompt_ids: list[int], gen: Generation, tokenizer, max_len: int,
                   params: GenParams, bad: Counter) -> dict | None:
    if not gen.finished and not params.keep_unfinished:
        bad["generation_unfinished"] += 1
        return None
    text = tokenizer.decode(gen.token_ids[:-1] if gen.finished else gen.token_ids, skip_special_tokens=False)
    if not text.strip():
        bad["empty_generation"] += 1
        return None
    if len(prompt_ids) + len(gen.token_ids) > max_len:
        bad["too_long"] += 1
        return None
    ids = list(prompt_ids) + list(gen.token_ids)
    mask = [False] * len(prompt_ids) + [True] * len(gen.token_ids)  # the reply and its stop token (if it has one)
    if not gen.finished:
        bad[KEPT_UNFINISHED] += 1  # a row written, not a drop: summarize() reports it apart
    return _row_dict(spec, text, ids, mask, params)


def build_shard(records: list[dict], first_index: int, tokenizer, max_len: int, params: GenParams | None = None,
                generator: ReplyGenerator | None = None, batch_size: int = 8,
                progress: Progress | None = None) -> tuple[pa.Table, Counter]:
    """Rows of `records` (source indices first_index, ...) as a table in (source_index, turn_index) order, plus
    the counts of what was dropped and why. When regenerating, `progress(done, total)` is called as each batch's
    replies come back."""
    if (params is None) != (generator is None):
        raise ValueError("regeneration needs both generation params and a generator")
    bad: Counter = Counter()
    specs: list[RowSpec] = []
    for k, record in enumerate(records):
        try:
            messages = normalize_record(record)
        except BadRecord as e:
            bad[e.reason] += 1
            continue
        rows, row_bad = split_turns(first_index + k, messages, regenerate=params is not None)
        specs += rows
        bad.update(row_bad)
    if params is not None:
        rows = _regenerate(specs, tokenizer, max_len, params, generator, batch_size, bad, progress)
    else:
        rows = []
        for spec in specs:
            if surely_too_long(tokenizer, spec.prompt + [{"content": spec.response}], max_len):
                bad["too_long"] += 1
                continue
            ids, mask = render_row(tokenizer, spec.prompt, spec.response, name=spec.row_id)
            if len(ids) > max_len:
                bad["too_long"] += 1
            else:
                rows.append(_row_dict(spec, spec.response, ids, mask, None))
    keys = [(r["source_index"], r["turn_index"]) for r in rows]
    assert keys == sorted(keys), "rows must come out in (source_index, turn_index) order"
    table = pa.Table.from_pylist(rows, schema=SCHEMA) if rows else SCHEMA.empty_table()
    return table, bad


# ---- loading the output -----------------------------------------------------------------------------------------


def shard_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files of a finished data-stage directory in row order, or [path] for a single .parquet file."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".parquet":
            raise ValueError(f"{path} is not a .parquet file")
        return [path]
    progress = path / "progress.json"
    if not progress.exists():
        raise FileNotFoundError(f"{path} is neither a .parquet file nor a data-stage directory (no progress.json)")
    try:
        state = json.loads(progress.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"data-stage directory {path}: {progress.name} is not valid JSON ({e}); rerun "
                         "launch/prepare_data.py with the same arguments") from None
    if not state.get("complete"):
        raise ValueError(f"data stage in {path} did not finish ({len(state['completed'])} of "
                         f"{state['num_shards']} shards); rerun launch/prepare_data.py with the same arguments")
    return [path / state["completed"][k]["file"] for k in sorted(state["completed"])]


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _list_of(value_ok: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda t: (pa.types.is_list(t) or pa.types.is_large_list(t)) and value_ok(t.value_type)


# the columns training reads, what each must hold, and that in words
TOKEN_COLUMNS = {"input_ids": (_list_of(pa.types.is_integer), "a list of integers"),
                 "loss_mask": (_list_of(lambda t: pa.types.is_boolean(t) or pa.types.is_integer(t)),
                               "a list of booleans")}


def check_token_columns(f: Path) -> None:
    """ValueError (one line naming the file) when `f` is no Parquet file, lacks a column training reads, or holds
    the wrong type in it. Reads the schema only."""
    try:
        schema = pq.read_schema(f)
    except (pa.ArrowException, OSError) as e:
        raise unreadable(f, e) from None
    problems = []
    for name, (ok, what) in TOKEN_COLUMNS.items():
        if name not in schema.names:
            problems.append(f"no column {name}")
        elif not ok(schema.field(name).type):
            problems.append(f"{name} is {schema.field(name).type}, not {what}")
    if problems:
        wanted = " and ".join(f"{n} ({w})" for n, (_, w) in TOKEN_COLUMNS.items())
        raise ValueError(f"data {f}: {'; '.join(problems)}; training reads {wanted}, as launch/prepare_data.py "
                         f"writes them (its columns: {schema.names[:12]})")


def unreadable(f: Path, e: BaseException) -> ValueError:
    return ValueError(f"data {f} is not a readable Parquet file ({_first_line(e)})")


def check_row_lengths(f: Path, first_row: int, offsets: np.ndarray, mask_offsets: np.ndarray) -> None:
    """ValueError naming the file and row where input_ids and loss_mask differ in length (offsets of a batch whose
    first row is `first_row` of the file)."""
    if not np.array_equal(np.diff(offsets), np.diff(mask_offsets)):
        row = int(np.flatnonzero(np.diff(offsets) != np.diff(mask_offsets))[0])
        raise ValueError(f"data {f} row {first_row + row}: input_ids has {offsets[row + 1] - offsets[row]} tokens "
                         f"but loss_mask {mask_offsets[row + 1] - mask_offsets[row]}")


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
