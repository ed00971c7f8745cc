"""Files of the serving package: JSON (calibration.json, SPS tables) with atomic writes and one-line read errors,
and where a Hugging Face checkpoint keeps each tensor."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.atomic import write_text_atomic


def atomic_write_json(path: str | Path, obj: object) -> Path:
    """Write obj as JSON to path so that a reader sees either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")
    return path


def read_json(path: str | Path, what: str) -> object:
    """Parse a JSON file; a missing or unparsable file is a one-line ValueError naming `what` and the path."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed {what} {path}: not JSON ({e.msg} at line {e.lineno})") from None


SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_weight_map(checkpoint: str | Path) -> dict[str, str]:
    """{tensor name: file name} of a checkpoint directory: its model.safetensors.index.json, else the keys of every
    *.safetensors file in it (empty when it has none)."""
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    if (checkpoint / SAFETENSORS_INDEX).is_file():
        return json.loads((checkpoint / SAFETENSORS_INDEX).read_text())["weight_map"]
    weight_map = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    return weight_map
