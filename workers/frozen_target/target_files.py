"""A target's files checked on the driver before any worker loads them: every JSON file of a model directory
parses, config.json is one transformers builds, the chat template compiles, the tokenizer has its files, every
safetensors file reads (header, length) and the weights agree with config.json (each tensor has the shape that the
model config.json describes gives that name, and every one of num_hidden_layers is present); a .gguf target reads
as GGUF. Each problem is an InputError naming the file and what is wrong (one line, exit status 2), where a worker
would otherwise fail on it minutes later with a library's text or a traceback. The launcher (workers/inputs.py),
the data stage, the evaluator and the exporter call `check_target_files` right after resolving the target.

Not checked: the tensors' bytes themselves (a bit flipped inside a tensor reads fine; no checksum exists to check).
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import InputError
from pipeline.input_files import read_json_file, safetensors_shapes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def check_target_files(path: Path) -> None:
    """InputError naming the file for the first problem found in the target at `path` (a resolved target)."""
    try:
        if not path.exists():
            raise InputError(f"target {path} does not exist")
        if path.is_file():
            _check_gguf(path)
            return
        config_json = path / "config.json"
        if not config_json.is_file():
            raise InputError(f"target {path} has no config.json: a target is a model directory (config.json, "
                             "tokenizer, *.safetensors) or a .gguf file")
        for f in sorted(path.glob("*.json")):
            read_json_file(f)
        config = _config(path, config_json)
        _check_tokenizer(path)
        _check_weights(path, config)
    except InputError:
        raise
    except ValueError as e:  # read_json_file's and safetensors_shapes' one line, naming the file
        raise InputError(f"target {e}") from None


def _check_gguf(path: Path) -> None:
    if path.suffix != ".gguf":
        raise InputError(f"target {path} is a file but not a .gguf file (or give a model directory)")
    from gguf import GGUFReader

    try:
        GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (the reader raises what its parse hits: ValueError, struct.error, ...)
        raise InputError(f"target {path} is not a readable GGUF file ({type(e).__name__}: "
                         f"{str(e).strip()[:200] or 'damaged'})") from None


def _config(path: Path, config_json: Path):
    """The config transformers builds from config.json; InputError for one it refuses."""
    raw = read_json_file(config_json)
    if not isinstance(raw, dict) or not raw.get("model_type"):
        raise InputError(f"target {config_json} names no model_type (a transformers config.json does)")
    from transformers import AutoConfig

    try:
        tc = AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 (an unknown model_type, a value transformers refuses, ...)
        said = " ".join(ln.strip() for ln in str(e).strip().splitlines())[:300] or type(e).__name__
        raise InputError(f"target {config_json} is not a config transformers can build ({said})") from None
    return tc


def _check_tokenizer(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(f"target {path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        template, where = template_file.read_text(errors="replace"), template_file
    else:
        tokenizer_config = path / "tokenizer_config.json"
        raw = read_json_file(tokenizer_config) if tokenizer_config.is_file() else {}
        template, where = (raw.get("chat_template") if isinstance(raw, dict) else None), tokenizer_config
    if isinstance(template, str):
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import _compile_jinja_template

        try:
            _compile_jinja_template(template)  # as apply_chat_template compiles it
        except TemplateError as e:
            line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise InputError(f"target {where}{line}: the chat template does not compile ({e.message})") from None


def _check_weights(path: Path, config) -> None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json_file(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict):
            raise InputError(f"target {index} has no weight_map")
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise InputError(f"target {index} names {len(missing)} file(s) {path} lacks: {', '.join(missing[:3])}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            return  # PyTorch pickles: torch reads (and checks) them when the worker loads the target
        raise InputError(f"target {path} holds no weights (*.safetensors)")
    stored: dict[str, tuple[Path, list[int]]] = {}
    for f in files:
        stored.update({name: (f, shape) for name, shape in safetensors_shapes(f).items()})
    expected = _model_shapes(config)
    for name, (f, shape) in sorted(stored.items()):
        if name in expected and shape != expected[name]:
            raise InputError(f"target {f}: {name} is {shape}, but config.json makes it {expected[name]}")
    tc = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(tc.num_hidden_layers)
    found = {int(m.group(1)) for name in stored if (m := LAYER.search(name))}
    absent = sorted(set(range(layers)) - found)
    if found and absent:
        raise InputError(f"target {path}: config.json says num_hidden_layers {layers}, but the weights hold no "
                         f"layer {absent[0]}{f' (nor {len(absent) - 1} more)' if len(absent) > 1 else ''}")


def _model_shapes(config) -> dict[str, list[int]]:
    """Parameter name -> shape of the model config.json describes, built on the meta device (no memory, no time
    to speak of). Names the checkpoint stores differently (transformers converts some, e.g. fused MoE experts) are
    not compared; {} where transformers cannot build the model from its config alone."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (the worker's own load says why, in its own words)
        return {}
    return {name: list(t.shape) for name, t in model.state_dict().items()}
