"""Elastic resume: continue a run on a different number of trainers at the same step and the same global batch.

Trainer rank r of R at step s, micro-step m of A consumes feature batch (s*A + m)*R + r (pipeline/order.py), and
the loss is normalised by the global Σw (workers/trainer/step.optimizer_step), so keeping A*R fixed keeps the set of
feature batches of every step and, up to float summation order, the update. Two pieces make that work:

- the driver (`adapt_to_checkpoint`, before any worker starts) runs a config whose train.grad_accum is
  A_old*R_old / R_new, and
  refuses a trainer count that does not divide the checkpoint's global batch or a ZeRO stage that cannot reshard;
- each trainer rank (`universal_source` + `load_universal`, so a Ray Train FailureConfig restart that resolves
  its own checkpoint gets it too) converts a checkpoint written by another world size with DeepSpeed's
  universal-checkpoint tool into <run_dir>/reshard/step_XXXXXXXX (rank 0 converts, the others wait in a
  collective), then loads it with `"checkpoint": {"load_universal": true}`.

ZeRO stages (DeepSpeed 0.19.8, fp32, CPU; tests/test_elastic_resume.py):
  0  every rank saves the whole optimizer in mp_rank_00_model_states.pt, so a plain load works at any world size:
     no conversion (ds_to_universal does not cover stage 0, DeepSpeed #7200).
  1, 2  ds_to_universal + load_universal.
  3  the same, plus `repair_zero3_universal_load` (two DeepSpeed slips that made the resumed run drift).
What DeepSpeed's universal load does not restore, this module does: it never loads the module's state dict, so the
MoE balance bias (`router_bias_E`, a persistent buffer updated outside the optimizer) would silently restart at
zero; buffers are copied from the checkpoint's model-states file. Torch RNG: rank r < R_old restores
rng_rank{r}.pt, a new rank keeps its `train.seed` state. Nothing in training draws from torch's global RNG (no
dropout; anchors come from pipeline/packing seeded by (seed, epoch), MoE routing is deterministic), so this does
not change any loss; it is kept for code that might.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pipeline.config import RunConfig
from workers.trainer.step import all_reduce_sum

ELASTIC_STAGES = (0, 1, 2, 3)  # every stage the config accepts; kept so that a new one must be added on purpose
RESHARD_DIR = "reshard"


def saved_world(meta: dict[str, Any]) -> tuple[int, int]:
    """(world size, grad_accum) the checkpoint was trained with."""
    pos = meta["data_position"]
    return int(pos["world_size"]), int(pos["grad_accum"])


def elastic_grad_accum(cfg: RunConfig, meta: dict[str, Any]) -> int:
    """The grad_accum that keeps the checkpoint's global batch (A_old * R_old) on cfg.cluster.num_trainers."""
    r_old, a_old = saved_world(meta)
    r_new, global_batch = cfg.cluster.num_trainers, r_old * a_old
    if global_batch % r_new:
        counts = [r for r in range(1, global_batch + 1) if global_batch % r == 0]
        raise ValueError(f"cannot resume on {r_new} trainers: the checkpoint's global batch is {global_batch} feature "
                         f"batches per step ({r_old} trainers x grad_accum {a_old}); use {counts} trainers")
    return global_batch // r_new


def elastic_world(cfg: RunConfig, world: int) -> RunConfig:
    """Trainer side: the config of a trainer group Ray Train formed with `world` ranks where the run asked for
    cluster.num_trainers (elastic, cluster.min_trainers): the same global batch (grad_accum x num_trainers as
    launched), grad_accum = global batch / world, so every step trains the same feature batches in the same order
    (pipeline/order.py) whatever the group's size."""
    global_batch = cfg.train.grad_accum * cfg.cluster.num_trainers
    if global_batch % world:  # the config refuses a min_trainers that allows this
        raise ValueError(f"a trainer group of {world} cannot keep the global batch of {global_batch} feature batches")
    return replace(cfg, train=replace(cfg.train, grad_accum=global_batch // world),
                   cluster=replace(cfg.cluster, num_trainers=world))


def check_stage(cfg: RunConfig, meta: dict[str, Any]) -> None:
    """A world-size change needs a ZeRO stage that can reshard, both in the checkpoint and now."""
    r_old, _ = saved_world(meta)
    if r_old == cfg.cluster.num_trainers:
        return
    stages = {int(meta["config"]["train"]["zero_stage"]), cfg.train.zero_stage}
    if not stages <= set(ELASTIC_STAGES):
        raise ValueError(f"cannot resume a {r_old}-trainer checkpoint on {cfg.cluster.num_trainers} trainers with "
                         f"ZeRO stage {sorted(stages)}: elastic resume supports stages {list(ELASTIC_STAGES)} "
                         f"(docs/elastic-resume.md); resume on {r_old} trainers")


def adapt_to_checkpoint(cfg: RunConfig, meta: dict[str, Any], log: logging.Logger) -> RunConfig:
    """Driver side, before check_resume: the config to resume with, `cfg` with the train.grad_accum that keeps the
    checkpoint's global batch on this trainer count (a grad_accum given on the command line is overridden: the
    global batch is what a resume must keep). `cfg` itself is left as it was given."""
    check_stage(cfg, meta)
    ga = elastic_grad_accum(cfg, meta)
    r_old, a_old = saved_world(meta)
    if (r_old, a_old) != (cfg.cluster.num_trainers, ga) or ga != cfg.train.grad_accum:
        log.info("elastic resume: %d trainers x grad_accum %d (checkpoint: %d x %d, global batch %d)",
                 cfg.cluster.num_trainers, ga, r_old, a_old, r_old * a_old)
    return replace(cfg, train=replace(cfg.train, grad_accum=ga))


def universal_source(path: str | Path | None, cfg: RunConfig, rank: int, world: int) -> Path | None:
    """Collective (every rank calls it before building its engine). None: load `path` as it is (a fresh start, the
    same world size, or ZeRO-0). Else the universal copy of `path`, converted by rank 0 unless already there."""
    if path is None:
        return None
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    r_old, _ = saved_world(meta)
    if r_old == world or int(meta["config"]["train"]["zero_stage"]) == 0:
        return None
    if cfg.train.zero_stage not in ELASTIC_STAGES:  # the driver refuses this first; a FailureConfig restart may not
        raise RuntimeError(f"{path} was written by {r_old} ranks and this is {world}: ZeRO-{cfg.train.zero_stage} "
                           f"cannot reshard (supported: {list(ELASTIC_STAGES)})")
    out = Path(cfg.checkpoint.run_dir) / RESHARD_DIR / path.name
    error = ""
    if rank == 0:
        try:
            convert(path, out, meta)
        except Exception as e:  # reported on every rank below, instead of leaving the others in the collective
            error = f"{type(e).__name__}: {e}"
    if all_reduce_sum([1.0 if error else 0.0])[0] > 0:
        raise RuntimeError(f"converting {path} to a universal checkpoint failed on rank 0"
                           + (f": {error}" if error else ""))
    return out


def convert(path: Path, out: Path, meta: dict[str, Any]) -> Path:
    """`path`'s DeepSpeed state as a universal checkpoint in `out` (written to out.tmp, then renamed). Reused when
    `out` is complete and made from this very checkpoint (same step and save time); other copies are removed."""
    source = {"checkpoint": path.name, "step": meta["step"], "saved_at": meta.get("saved_at"),
              "world_size": saved_world(meta)[0]}
    record = out / "source.json"
    if record.is_file() and json.loads(record.read_text()) == source:
        return out
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():  # a universal copy is only read at a restart: older ones are dead weight
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / (out.name + ".tmp")
    # a subprocess: the converter holds every rank's shards at once, and its memory goes back when it exits;
    # one worker each, so it spawns no process pool inside a Ray worker. --inject_missing_state: our engine does
    # not record UNIVERSAL_CHECKPOINT_INFO (only Megatron/AutoTP models do), and it needs no TP/PP patterns.
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(path / "ds"),
           "--output_folder", str(tmp / "ds"), "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"ds_to_universal exited {res.returncode}: {tail[0]}")
    (tmp / "source.json").write_text(json.dumps(source))
    os.replace(tmp, out)  # ds_to_universal wrote tmp/latest_universal ("ds"); it moves with the directory
    return out


def load_universal(engine: Any, universal: Path, path: str | Path, rank: int, log: logging.Logger) -> int:
    """Restore `engine` (built with load_universal, `workers/trainer/engines.deepspeed_engine`) from `universal`,
    the converted copy of checkpoint `path`; returns the step. The LR scheduler, DeepSpeed's step counters and Adam's
    moments and step come from the universal checkpoint; buffers and RNG are restored here."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    kind = type(engine).__name__
    if meta.get("engine", kind) != kind:
        raise RuntimeError(f"{path} holds {meta['engine']} state; elastic resume needs the DeepSpeed trainer")
    load_path, _ = engine.load_checkpoint(str(universal), tag="ds", load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"the engine could not load the universal checkpoint in {universal}")
    restore_buffers(engine.module, universal / "ds")
    if engine.zero_optimization_stage() == 3:
        repair_zero3_universal_load(engine.optimizer.optimizer, universal / "ds")
    rng = path / f"rng_rank{rank}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    r_old, a_old = saved_world(meta)
    log.info("resumed from %s (written by %d ranks x grad_accum %d) through %s at step %d", path, r_old, a_old,
             universal, int(meta["step"]))
    return int(meta["step"])


def load_universal_file(path: Path) -> Any:
    """A file of a universal copy under <run_dir>/reshard/, loaded without running code from it: torch's
    weights-only unpickler, which admits tensors, plain containers and the globals allowed here. DeepSpeed 0.19.8
    pickles two of its own types into these files besides those (torch.serialization.get_unsafe_globals_in_checkpoint
    on the universal copies of ZeRO-1/2/3 checkpoints): the ZeRO stage as an enum and the fp16 loss scaler's state
    (an object with plain attributes; its class is only instantiated, no method of it runs)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler]):
        return torch.load(path, map_location="cpu", weights_only=True)


def repair_zero3_universal_load(optimizer: torch.optim.Optimizer, ds_dir: Path) -> None:
    """Undo two slips of ZeRO-3's universal load (stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3,
    DeepSpeed 0.19.8); with them the 2 -> 1 -> 2 resumed losses were off the uninterrupted run's by up to 1e-3
    within 4 steps, with both undone they are equal (tests/test_elastic_resume.py):
    - it copies the first param group's hyperparameters into every group, so the head group (lr x
      train.head_lr_scale, workers/trainer/step.param_groups) would train at the backbone's lr: put back each
      group's own, saved in the universal checkpoint's optimizer_state.pt;
    - it gives every group's state the *same* `step` tensor, which torch's Adam increments in place once per
      group per optimizer step, so the bias correction ran ahead: give each group its own copy."""
    saved = load_universal_file(ds_dir / "zero" / "optimizer_state.pt")
    groups = saved["optimizer_state_dict"]["param_groups"]
    for group, want in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in want.items() if k != "params"})
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def restore_buffers(module: torch.nn.Module, ds_dir: Path) -> None:
    """Copy the persistent buffers (MoE balance bias) from a DeepSpeed model-states file into `module`."""
    files = sorted(ds_dir.glob("*model_states.pt"))
    assert files, f"no model-states file in {ds_dir}"
    saved = load_universal_file(files[0])["module"]
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in saved:
                buf.copy_(saved[name].to(buf.dtype))
