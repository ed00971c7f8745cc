"""Atomic, resumable checkpoints of a draft in training (any engine with DeepSpeed's save_checkpoint /
load_checkpoint), and the final export.

Layout under <run_dir>/checkpoints/:
    step_00000050/          one complete checkpoint
        ds/...              engine state: DeepSpeed's model, per-rank optimizer shards and LR scheduler, or
                            (single process) TorchEngine's model.safetensors, optimizer.pt, scheduler.pt
        rng_rank{r}.pt      each rank's torch RNG state
        meta.json           step, data position, the resolved run config, the engine's class, wall time
    latest                  text file naming the newest complete checkpoint directory
A checkpoint is written into `step_XXXXXXXX.tmp/` by all ranks and renamed by rank 0 only after every rank
finished and meta.json is on disk, so a crash at any point leaves either the old `latest` or a complete new one;
stale `.tmp` directories are removed on the next save.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import write_text_atomic

LATEST = "latest"


def _step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int = 3) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None. A `latest` naming a missing directory is an error."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "meta.json").is_file():
            raise RuntimeError(f"{pointer} names {path.name}, which is missing or incomplete; "
                               f"point it at a complete checkpoint under {self.root} or remove it")
        return path

    def save(self, engine: Any, step: int, meta: dict[str, Any], rank: int, barrier: Callable[[], None],
             extra_files: Callable[[Path], None] | None = None) -> Path:
        """Collective: every rank calls it with the same step. Returns the final checkpoint directory.
        `extra_files(tmp_dir)` runs on rank 0 after every rank wrote its state, before meta.json: files it writes
        there are committed with the checkpoint (the sample ledger)."""
        final = self.root / _step_dir_name(step)
        tmp = self.root / (_step_dir_name(step) + ".tmp")
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        engine.save_checkpoint(str(tmp), tag="ds")
        torch.save(torch.get_rng_state(), tmp / f"rng_rank{rank}.pt")
        barrier()
        if rank == 0:
            if extra_files is not None:
                extra_files(tmp)
            record = {**meta, "step": step, "saved_at": time.time()}
            write_text_atomic(tmp / "meta.json", json.dumps(record, indent=1, default=str))
            if final.exists():  # a re-run of the same step after a crash: replace it with the fresh one
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            self._prune()
        barrier()
        return final

    def load(self, engine: Any, path: Path, rank: int) -> dict[str, Any]:
        """Restore the engine's state and this rank's RNG; returns meta.json."""
        meta = json.loads((path / "meta.json").read_text())
        kind = type(engine).__name__
        if meta.get("engine", kind) != kind:
            raise RuntimeError(f"{path} holds {meta['engine']} state and this run trains with {kind}: resume it with "
                               "the trainer that wrote it (with or without --single-process), or use a new run dir")
        load_path, _ = engine.load_checkpoint(str(path), tag="ds", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"the engine could not load the checkpoint in {path}")
        rng = path / f"rng_rank{rank}.pt"
        if rng.is_file():
            torch.set_rng_state(torch.load(rng, weights_only=True))
        return meta

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def export_draft(state_dict: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str | Path) -> Path:
    """Write the trained draft as model.safetensors + config.json (without the target's embedding/LM head)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def load_exported_draft(export_dir: str | Path, embed_VD: torch.Tensor, lm_head_VD: torch.Tensor) -> torch.nn.Module:
    """Rebuild a draft written by `export_draft` on the target's frozen embedding and LM head (eval mode)."""
    from safetensors.torch import load_file

    from draft_model.registry import build_draft
    from pipeline.config import config_from_dict

    d = Path(export_dir)
    if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d} is not an exported draft (needs config.json and model.safetensors)")
    meta = json.loads((d / "config.json").read_text())
    cfg = config_from_dict({"draft": meta["draft"]}).draft
    model = build_draft(cfg, embed_VD, lm_head_VD)
    missing, unexpected = model.load_state_dict(load_file(str(d / "model.safetensors")), strict=False)
    if missing or unexpected:
        raise ValueError(f"{d}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return model.eval()
