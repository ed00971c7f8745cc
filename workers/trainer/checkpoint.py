"""Atomic, verified, resumable checkpoints of a draft in training (any engine with DeepSpeed's save_checkpoint /
load_checkpoint). The final export is pipeline/export.py.

Layout under <run_dir>/checkpoints/:
    step_00000050/          one complete checkpoint
        ds/...              engine state: DeepSpeed's model, per-rank optimizer shards and LR scheduler, or
                            (single process) TorchEngine's model.safetensors, optimizer.pt, scheduler.pt
        rng_rank{r}.pt      each rank's torch RNG state
        (extra files)       whatever `save(extra_files=...)` wrote on rank 0, e.g. the sample ledger
        meta.json           step, data position, the resolved run config, the engine's class, wall time, format
        manifest.json       written last: every other file's relative path, size and sha256
    latest                  text file naming the newest complete checkpoint directory
A checkpoint is written into `step_XXXXXXXX.tmp/` by all ranks; after every rank finished, rank 0 writes the extra
files and meta.json, hashes and fsyncs every file, fsyncs the directories, writes manifest.json, renames the
directory and replaces `latest` (fsyncing the checkpoints directory after each). A crash at any point leaves
either the old `latest` or a complete new one; stale `.tmp` directories are removed on the next save.

`latest()` does not trust the pointer: it verifies the manifest of the checkpoint it names and falls back to the
newest older one that verifies (docs/fault-tolerance.md). The manifest detects corruption (truncation, lost or
flipped bytes, missing files), not tampering: whoever can write the run dir can also rewrite the manifest, and
DeepSpeed unpickles its own checkpoint files (see "Trust boundary" there).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.atomic import fsync_dir, sha256_file, write_text_atomic
from pipeline.metrics import get_logger
from workers.lease import LeaseLost

LATEST = "latest"
MANIFEST = "manifest.json"
FORMAT = 2  # meta.json["format"] and manifest.json["format"]: 2 = manifest.json written last
VERIFY_MODES = ("full", "size")  # full: sizes and sha256 of every file; size: existence and sizes only
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointError(RuntimeError):
    """The run dir's checkpoints cannot be used as they are; the message is one line for the user."""


class StorageError(CheckpointError):
    """A save failed because the run dir cannot hold it (a full disk, a quota, a read-only file system, a permission
    error): a restart would fail the same way after re-training the same steps, so it is fatal
    (workers/trainer/ray_trainer.FATAL_ERRORS). One line: what, how much the last checkpoint needed, what to do."""


# errno -> what the user reads; what to do about it
STORAGE_ERRNOS = {
    errno.ENOSPC: ("the disk is full", "free space"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EROFS: ("the file system is read-only", "make the run dir writable"),
    errno.EACCES: ("permission is denied", "make the run dir writable for this user"),
    errno.EPERM: ("the operation is not permitted", "make the run dir writable for this user"),
}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|os error (\d+)")  # Python's OSError text, Rust's (safetensors)
FULL_BELOW = 1 << 20  # free bytes under which a write error without an errno (torch.save's zip writer) is ENOSPC


def storage_errno(e: BaseException, root: Path | None) -> int | None:
    """The errno of STORAGE_ERRNOS behind a failed save, or None if it is some other failure. torch.save reports
    a full disk as a RuntimeError without an errno ('unexpected pos ...'), safetensors as text ('os error 28'):
    the cause chain is searched, and an error with no errno on a disk (`root`'s) with less than 1 MiB free counts
    as full; with root None only an errno counts."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        code = getattr(x, "errno", None)
        if code is None and (m := _ERRNO_IN_TEXT.search(str(x))):
            code = int(m.group(1) or m.group(2))
        if code in STORAGE_ERRNOS:
            return code
        x = x.__cause__ or x.__context__
    if root is None:
        return None
    try:
        return errno.ENOSPC if shutil.disk_usage(root).free < FULL_BELOW else None
    except OSError:
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _dir_bytes(path: Path) -> int:
    """Bytes in the files under `path`; files that vanish while it counts (another rank removing the same partial
    dir after the same full disk) count as 0."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


def _step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(name: str) -> int | None:
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def write_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Hash and fsync every file under `ckpt_dir`, fsync its directories, then write manifest.json (atomically,
    last). Returns the manifest."""
    files = {}
    for p in sorted(ckpt_dir.rglob("*")):
        if p.is_file() and p.relative_to(ckpt_dir).as_posix() != MANIFEST:
            size, digest = sha256_file(p, fsync=True)
            files[p.relative_to(ckpt_dir).as_posix()] = {"size": size, "sha256": digest}
    for d in sorted((p for p in ckpt_dir.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(d)
    manifest = {"format": FORMAT, "algorithm": "sha256", "files": files}
    write_text_atomic(ckpt_dir / MANIFEST, json.dumps(manifest, indent=1))
    fsync_dir(ckpt_dir)
    return manifest


def checkpoint_problem(path: Path, verify: str = "full") -> str | None:
    """Why `path` is not a usable checkpoint, as one phrase naming the file; None if it is.

    Checks that every file in manifest.json exists with its recorded size and (verify="full") its sha256. Files
    that are not in the manifest are ignored: the manifest answers "is everything that was saved still intact".
    A checkpoint without manifest.json lost it (save() writes it last, before the commit rename), and fails."""
    assert verify in VERIFY_MODES, verify
    if not path.is_dir():
        return "the directory does not exist"
    if not (path / "meta.json").is_file():
        return "meta.json is missing"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        entries = [(str(rel), int(want["size"]), str(want["sha256"])) for rel, want in files.items()]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    if "meta.json" not in files:  # save() always lists it: a manifest without it is not one save() wrote
        return f"{MANIFEST} does not list meta.json"
    for rel, want_size, want_sha in entries:
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        size = f.stat().st_size
        if size != want_size:
            return f"{rel} is {size} bytes, the manifest says {want_size}"
        if verify == "full":
            _, digest = sha256_file(f)
            if digest != want_sha:
                return f"{rel} has sha256 {digest[:12]}..., the manifest says {want_sha[:12]}..."
    # sealed but unreadable (the manifest proves the bytes are the ones saved, not that they parse)
    try:
        int(json.loads((path / "meta.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json does not parse ({type(e).__name__})"
    if verify == "full":  # the sample ledger (workers/trainer/ledger.py) and any other table saved with it
        import pyarrow.parquet as pq

        for rel, _, _ in entries:
            if rel.endswith(".parquet"):
                try:
                    pq.read_table(path / rel)
                except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds; any is "unreadable"
                    return f"{rel} does not read ({type(e).__name__})"
    return None


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep_last: int = 3, log: logging.Logger | None = None,
                 fence: Callable[[], None] | None = None) -> None:
        """`fence`: raises LeaseLost unless this process's driver still owns the run dir (workers/lease.Fence.
        check_commit); called by rank 0 before it touches anything shared: the .tmp clean-up, and the rename,
        `latest` and pruning of a commit."""
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.log = log or get_logger("dspark.checkpoint")
        self.fence = fence or (lambda: None)

    def latest(self, verify: str = "full") -> Path | None:
        """The checkpoint to resume from: the one `latest` names if it verifies, else the newest older one that
        does; None when the run dir has no checkpoint at all.

        Each checkpoint that fails is one warning line naming the file and why. If checkpoints exist but none
        verifies, CheckpointError: a silent fresh start would retrain from step 0 and then overwrite the evidence,
        so the user decides (repair, move them away, or a new run dir). Dirs newer than the one `latest` names are
        not considered (a crash between the rename and the pointer, or a pointer moved back by hand: the pointer
        wins). With no `latest` at all but step dirs present (a crash before the first pointer was written, or a
        deleted pointer), the newest verifying step dir is used, with a warning. verify="full" hashes every file
        (use it to resume); "size" checks existence and sizes only."""
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        steps = self._step_dirs()
        pointer = self.root / LATEST
        if not pointer.is_file():
            if not steps:
                return None
            self.log.warning("%s has step dirs but no %s pointer; using the newest one that verifies", self.root,
                             LATEST)
            candidates = steps[::-1]
        else:
            named = pointer.read_text().strip()
            named_step = _step_of(named)
            if named_step is None:
                raise CheckpointError(f"{pointer} holds {named!r}, not a step_XXXXXXXX name; point it at a "
                                      f"checkpoint under {self.root} or remove it")
            candidates = [self.root / named, *(d for d in steps[::-1] if _step_of(d.name) < named_step)]
            newer = [d.name for d in steps if _step_of(d.name) > named_step and checkpoint_problem(d, "size") is None]
            if newer:
                self.log.warning("%s %s complete but newer than %s, which %s names: not used (the pointer wins; "
                                 "write %s into it to resume from there)", ", ".join(newer),
                                 "is" if len(newer) == 1 else "are", named, pointer, newer[-1])
        first_problem = None
        for i, path in enumerate(candidates):
            problem = checkpoint_problem(path, verify)
            if problem is None:
                if i > 0:
                    self.log.warning("using %s, the newest checkpoint that verifies", path.name)
                return path
            first_problem = first_problem or f"{path.name}: {problem}"
            self.log.warning("checkpoint %s is unusable: %s; falling back to an older one", path.name, problem)
        raise CheckpointError(f"none of the {len(candidates)} checkpoint(s) under {self.root} verifies (newest "
                              f"{first_problem}); repair or move them away, or use a new --run-dir")

    def save(self, engine: Any, step: int, meta: dict[str, Any], rank: int, barrier: Callable[[], None],
             extra_files: Callable[[Path], None] | None = None) -> Path:
        """Collective: every rank calls it with the same step. Returns the final checkpoint directory.
        `extra_files(tmp_dir)` runs on rank 0 after every rank wrote its engine state, before meta.json and the
        manifest, so what it writes into tmp_dir is part of the verified checkpoint. A full disk, a quota, a
        read-only file system or a permission error is StorageError (one line), with the partial dir removed;
        LeaseLost when this run no longer owns the run dir."""
        tmp = self.root / (_step_dir_name(step) + ".tmp")
        try:
            return self._save(engine, step, meta, rank, barrier, extra_files, tmp)
        except (LeaseLost, CheckpointError):
            raise
        except Exception as e:
            code = storage_errno(e, self.root)
            if code is None:
                raise
            written = _dir_bytes(tmp)
            shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint must not keep the disk full
            raise StorageError(self._storage_message(code, step, written)) from e

    def write_failure(self, e: BaseException) -> StorageError | None:
        """A failed write outside a save (the metrics file, TensorBoard) that a restart would repeat (a full disk,
        a quota, a read-only file system, a permission error: by its errno) as StorageError; None otherwise."""
        code = storage_errno(e, None)
        if code is None:
            return None
        what, todo = STORAGE_ERRNOS[code]
        last = (self.root / LATEST).read_text().strip() if (self.root / LATEST).is_file() else None
        then = f"re-run the same command to resume from {last}" if last else "re-run the same command"
        return StorageError(f"cannot write under {self.root.parent}: {what} ({errno.errorcode[code]}): {e}; "
                            f"{todo}, then {then}")

    def _storage_message(self, code: int, step: int, written: int) -> str:
        what, todo = STORAGE_ERRNOS[code]
        try:
            last = (self.root / LATEST).read_text().strip()
            files = json.loads((self.root / last / MANIFEST).read_text())["files"]
            need = f"the last checkpoint, {last}, needed {_mib(sum(int(f['size']) for f in files.values()))}"
            then = f"re-run the same command to resume from {last}"
        except (OSError, ValueError, KeyError, TypeError):
            need = f"this first one had written {_mib(written)} when it failed"
            then = "re-run the same command"
        try:
            free = f"{_mib(shutil.disk_usage(self.root).free)} free now"
        except OSError:
            free = "free space unknown"
        return (f"cannot save checkpoint {_step_dir_name(step)} under {self.root}: {what} "
                f"({errno.errorcode[code]}); {need}, {free}; removed the partial {_step_dir_name(step)}.tmp; "
                f"{todo}, then {then}")

    def _save(self, engine: Any, step: int, meta: dict[str, Any], rank: int, barrier: Callable[[], None],
              extra_files: Callable[[Path], None] | None, tmp: Path) -> Path:
        final = self.root / _step_dir_name(step)
        if rank == 0:
            self.fence()
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
            record = {**meta, "step": step, "format": FORMAT, "saved_at": time.time()}
            write_text_atomic(tmp / "meta.json", json.dumps(record, indent=1, default=str))
            write_manifest(tmp)
            self.fence()  # the commit: only while this run's driver owns the run dir
            if final.exists():  # a re-run of the same step after a crash: replace it with the fresh one
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.root)
            write_text_atomic(self.root / LATEST, final.name + "\n")
            fsync_dir(self.root)
            self._prune(step)
        barrier()
        return final

    def load(self, engine: Any, path: Path, rank: int) -> dict[str, Any]:
        """Restore the engine's state and this rank's RNG; returns meta.json. Sizes are checked against the
        manifest (the full hash check is `latest()`'s, once, before the trainers start)."""
        problem = checkpoint_problem(path, "size")
        if problem is not None:
            raise CheckpointError(f"cannot load {path}: {problem}")
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

    def _step_dirs(self) -> list[Path]:
        """Finished step dirs (not .tmp), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and _step_of(p.name) is not None)

    def _prune(self, saved_step: int) -> None:
        """Keep the `keep_last` newest checkpoints up to the one just saved. Dirs of later steps (left by a run
        that resumed from an older checkpoint because a newer one was corrupt) are not counted, so they can never
        push the fresh checkpoint out; the run replaces each when it saves that step again."""
        done = [p for p in self._step_dirs() if _step_of(p.name) <= saved_step]
        for old in done[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
