"""The exported draft: model.safetensors + config.json, written at the end of a run and read by every consumer.

    export/
        model.safetensors   the draft's trained weights (fp32; the target's frozen embedding and LM head left out)
        config.json         {"draft": DraftConfig.to_dict(), "target": target.path, "format": "dspark-draft-v1"}
        calibration.json    (later, optional) STS temperatures written by launch/calibrate_draft.py

The writer (the trainers) and the reader (evaluation, bench) share this module, below both, so the format is
defined once and the evaluator does not reach into the trainer's checkpoint code to read it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from draft_model.config import DraftConfig
from draft_model.registry import build_draft
from pipeline.config import RunConfig, config_from_dict


def export_meta(cfg: RunConfig) -> dict[str, Any]:
    """config.json of a run's export: what `load_exported_draft` rebuilds from."""
    return {"draft": cfg.draft.to_dict(), "target": cfg.target.path, "format": "dspark-draft-v1"}


def write_export_dir(out_dir: str | Path, tensors: dict[str, torch.Tensor], files: dict[str, str],
                     metadata: dict[str, str] | None = None, weights_file: str = "model.safetensors",
                     links: dict[str, Path] | None = None) -> Path:
    """`out_dir` replaced atomically by `weights_file` (`tensors`), the text `files` (name -> contents) and
    symlinks (`links`: name -> the file it points at): a reader sees the old directory or the complete new one.
    Every export format is written through it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, target in (links or {}).items():
        os.symlink(target, tmp / name)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / weights_file),
              metadata=metadata)
    for name, text in files.items():
        (tmp / name).write_text(text)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def export_draft(state_dict: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str | Path) -> Path:
    """Write the trained draft as model.safetensors + config.json (without the target's embedding/LM head)."""
    return write_export_dir(out_dir, state_dict, {"config.json": json.dumps(config, indent=1)})


def read_export(export_dir: str | Path) -> tuple[DraftConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(draft config, state dict, config.json) of a directory written by `export_draft`; a damaged or foreign file
    is a ValueError naming it (pipeline/input_files.py)."""
    from pipeline.input_files import load_safetensors

    cfg, meta = check_export(export_dir)
    return cfg, load_safetensors(Path(export_dir) / "model.safetensors"), meta


def check_export(export_dir: str | Path) -> tuple[DraftConfig, dict[str, Any]]:
    """(draft config, config.json) of an exported draft, its weights' header read (not its tensors): what a command
    checks before it loads a target; FileNotFoundError / ValueError naming the file that is missing or damaged."""
    from pipeline.config import ConfigError
    from pipeline.input_files import read_json_file, safetensors_shapes

    d = Path(export_dir)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d} is not an exported draft (needs config.json and model.safetensors)")
    meta = read_json_file(d / "config.json")
    if not isinstance(meta, dict) or "draft" not in meta:
        raise ValueError(f"{d}/config.json has no 'draft' section: not a dspark-train export")
    try:
        cfg = config_from_dict({"draft": meta["draft"]}).draft
    except ConfigError as e:
        raise ValueError(f"{d}/config.json: {e}") from None
    stored = safetensors_shapes(d / "model.safetensors")
    expected = _draft_shapes(cfg)
    for name, shape in sorted(stored.items()):
        if name in expected and shape != expected[name]:
            raise ValueError(f"{d}/model.safetensors: {name} is {shape}, but its config.json makes it "
                             f"{expected[name]}")
    return cfg, meta


def _draft_shapes(cfg: DraftConfig) -> dict[str, list[int]]:
    """Parameter name -> shape of the draft `cfg` describes, built on the meta device (nothing allocated); {} when
    the config leaves the target's sizes open (0) or the architecture does not build there."""
    if not (cfg.vocab_size and cfg.hidden_size):
        return {}
    try:
        with torch.device("meta"):
            frozen_VD = torch.empty(cfg.vocab_size, cfg.hidden_size)
            model = build_draft(cfg, frozen_VD, frozen_VD)
    except Exception:  # noqa: BLE001 (the load itself then says what does not fit)
        return {}
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def load_exported_draft(export_dir: str | Path, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor) -> torch.nn.Module:
    """Rebuild a draft written by `export_draft` on the target's frozen embedding and LM head (eval mode)."""
    cfg, state, _ = read_export(export_dir)
    model = build_draft(cfg, embed_VD, lm_head_VD)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape than config.json makes it
        raise ValueError(f"{export_dir}/model.safetensors does not fit its config.json: "
                         f"{str(e).strip().splitlines()[-1].strip()}") from None
    if missing or unexpected:
        raise ValueError(f"{export_dir}: weights do not match the config (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]})")
    return model.eval()
