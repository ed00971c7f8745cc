"""The JSON and safetensors files a user hands a command (a target directory's config and weights, an exported
draft), read so that a damaged one is one ValueError naming the file and what is wrong: the CLIs print it as one
line with exit status 2, where the libraries would raise their own text without the file's name (or a traceback).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else 'no message'}"


def read_json_file(path: str | os.PathLike) -> Any:
    """The JSON value of the file; ValueError naming it for bytes that are not UTF-8 or text that is not JSON."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise ValueError(f"{p} cannot be read: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        what = "is empty" if not text.strip() else f"is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno})"
        raise ValueError(f"{p} {what}") from None


def safetensors_shapes(path: str | os.PathLike) -> dict[str, list[int]]:
    """Tensor name -> shape, from the file's header, which safetensors checks against the file (its length
    covers every tensor's bytes, no more, no less) without reading the tensors: a truncated or damaged file is a
    ValueError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except Exception as e:  # noqa: BLE001 (SafetensorError, OSError, ...: the file is unusable either way)
        raise ValueError(f"{path} is not a readable safetensors file ({_one_line(e)})") from None


def load_safetensors(path: str | os.PathLike) -> dict[str, Any]:
    """The file's tensors (on the CPU); ValueError naming it when it does not read."""
    from safetensors.torch import load_file

    safetensors_shapes(path)
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path} is not a readable safetensors file ({_one_line(e)})") from None
