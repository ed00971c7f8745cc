"""The end of a run, after its own export: the engine formats (serving/engine_export.py) the draft can be served
in, beside it as <run_dir>/export-deepspec and <run_dir>/export-speculators. Shared by both trainers."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.config import RunConfig
from serving.engine_export import export_servable
from workers.frozen_target.model import resolve_target_path


def export_for_engines(export_dir: str | Path, cfg: RunConfig, log: logging.Logger) -> None:
    try:
        target_dir = resolve_target_path(cfg.target.path)
    except FileNotFoundError as e:  # a trainer on a node without the target: the CLI can write it later
        log.info("engine export skipped: %s", e)
        return
    export_servable(export_dir, cfg.checkpoint.run_dir, target_dir, cfg.target.path, log)
