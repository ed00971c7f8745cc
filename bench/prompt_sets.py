"""Training prompts for the drafter comparison (bench/drafters.py): never the evaluation ones, which live in
evaluation/prompts.py.

Training prompts, three kinds, all rendered as single-turn chats whose replies the target regenerates:
  chat  "Explain what `sig` from the Python module `m` does."   (standard-library functions with a docstring)
  code  "Implement `sig` as in the Python module `m`."           (same source, the other half of the functions)
  math  arithmetic word problems from seeded templates          (GSM8K-like, generated here, not GSM8K)
"""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from pipeline.data.corpus import function_prompts, stdlib_files

_MATH_TEMPLATES = [
    "A baker makes {a} loaves of bread every day for {b} days and sells {c} loaves in total. How many loaves are "
    "left? Explain your reasoning step by step.",
    "Maria has {a} dollars. She buys {b} books that cost {c} dollars each. How much money does she have left? "
    "Show your work.",
    "A train travels {a} kilometers per hour for {b} hours, then {c} kilometers per hour for {d} hours. How far "
    "does it travel in total? Think step by step.",
    "A garden has {a} rows of {b} tomato plants. Each plant gives {c} tomatoes. How many tomatoes does the garden "
    "give? Explain each step.",
    "Tom reads {a} pages on Monday and {b} pages more on Tuesday than on Monday. His book has {c} pages. How many "
    "pages does he still have to read? Explain.",
    "A class of {a} students is split into groups of {b}. How many full groups are there and how many students "
    "are left over? Show the calculation.",
]


def math_prompts(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.choice(_MATH_TEMPLATES)
        v = {k: rng.randint(2, 99) for k in "abcd"}
        out.append([{"role": "user", "content": t.format(**v)}])
    return out


def stdlib_prompts(n: int, seed: int, kind: str) -> list[list[dict]]:
    """`kind` "chat" (explain) or "code" (implement): user turns about standard-library functions."""
    base = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(base)
    random.Random(seed).shuffle(files)
    rng = random.Random(seed)
    want = "Explain" if kind == "chat" else "Implement"
    out: list[list[dict]] = []
    for path in files:
        for _, messages in function_prompts(path, base, rng):
            if messages[0]["content"].startswith(want):
                out.append(messages[:1])
                if len(out) == n:
                    return out
    return out


def training_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompt records ({"messages": [...], "kind": ...}), an equal mix of chat, code and math, shuffled."""
    per = -(-n // 3)
    records = ([{"messages": m, "kind": "chat"} for m in stdlib_prompts(per, seed, "chat")]
               + [{"messages": m, "kind": "code"} for m in stdlib_prompts(per, seed + 1, "code")]
               + [{"messages": m, "kind": "math"} for m in math_prompts(per, seed)])
    random.Random(seed).shuffle(records)
    return records[:n]
