"""Checkpoint integrity (workers/trainer/checkpoint.py) and resume checks (pipeline/resume.check_resume): every
checkpoint is sealed by a manifest written last; `latest()` falls back past a truncated, corrupted or unsealed
checkpoint to the newest older one that verifies, with one warning naming the file, and refuses when none does;
a resume refuses any change of a setting that alters the data or the model. The last test runs the real
single-process trainer (launch/train_v4_draft.py --single-process) on a run dir whose newest checkpoint is
truncated.

Run: python -m pytest tests/test_checkpoint_integrity.py -q     (about 10 s; with -m slow the e2e test, ~60 s)
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging

import pytest

from draft_model.config import LossConfig
from pipeline.config import RunConfig
from pipeline.errors import InputError
from pipeline.resume import check_resume
from workers.trainer.checkpoint import MANIFEST, CheckpointError, CheckpointManager, checkpoint_problem
from workers.trainer.ledger import write_ledger


class FakeEngine:
    """DeepSpeed's save/load interface over two files of bytes (one over the 1 MiB hash chunk), like its
    <dir>/<tag>/ files and the `latest` it writes into the save dir."""

    def __init__(self, seed: int = 0) -> None:
        self.state = bytes((seed * 7 + i) % 251 for i in range(3 << 19))  # 1.5 MiB
        self.loaded: bytes | None = None

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        from pathlib import Path

        out = Path(save_dir) / tag
        out.mkdir(parents=True, exist_ok=True)
        (out / "mp_rank_00_model_states.pt").write_bytes(self.state)
        (out / "optim_states.pt").write_bytes(self.state[:1000])
        (Path(save_dir) / "latest").write_text(tag)

    def load_checkpoint(self, load_dir: str, tag: str, **_) -> tuple[str | None, dict]:
        from pathlib import Path

        self.loaded = (Path(load_dir) / tag / "mp_rank_00_model_states.pt").read_bytes()
        return load_dir, {}


@pytest.fixture
def log(caplog):
    logger = logging.getLogger("test.checkpoint")
    logger.propagate = True
    caplog.set_level(logging.INFO, logger="test.checkpoint")
    return logger


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _save_steps(run_dir, log, steps=(2, 4, 6), keep_last=3) -> CheckpointManager:
    ckpts = CheckpointManager(run_dir, keep_last=keep_last, log=log)
    for s in steps:
        ckpts.save(FakeEngine(s), s, {"config": {}, "engine": "FakeEngine"}, 0, lambda: None)
    return ckpts


def test_manifest_is_written_last_and_lists_every_file(tmp_path, log):
    seen = {}

    def ledger(tmp_dir):  # rank 0's extra files: after the engine state, before meta.json and the manifest
        seen["dir"] = tmp_dir.name
        seen["engine_done"] = (tmp_dir / "ds" / "mp_rank_00_model_states.pt").is_file()
        seen["meta_yet"] = (tmp_dir / "meta.json").exists()
        write_ledger([(1, 0, 0, 1, (3, 1))], tmp_dir / "ledger.parquet", "digest")

    ckpts = CheckpointManager(tmp_path, log=log)
    path = ckpts.save(FakeEngine(), 2, {"config": {}}, 0, lambda: None, extra_files=ledger)
    assert seen == {"dir": "step_00000002.tmp", "engine_done": True, "meta_yet": False}
    assert path.name == "step_00000002" and not list(tmp_path.glob("checkpoints/*.tmp"))

    manifest = json.loads((path / MANIFEST).read_text())
    on_disk = {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == set(on_disk) - {MANIFEST}
    assert set(manifest["files"]) == {"ds/mp_rank_00_model_states.pt", "ds/optim_states.pt", "latest",
                                      "rng_rank0.pt", "ledger.parquet", "meta.json"}
    for rel, entry in manifest["files"].items():
        data = on_disk[rel].read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert manifest["files"]["ds/mp_rank_00_model_states.pt"]["size"] == 3 << 19
    last = max(p.stat().st_mtime_ns for p in on_disk.values())
    assert (path / MANIFEST).stat().st_mtime_ns == last  # nothing was written after it
    assert json.loads((path / "meta.json").read_text())["format"] == 2
    assert ckpts.latest() == path and checkpoint_problem(path) is None


def test_truncated_newest_falls_back_to_the_previous_one(tmp_path, log, caplog):
    ckpts = _save_steps(tmp_path, log)
    victim = ckpts.root / "step_00000006" / "ds" / "mp_rank_00_model_states.pt"
    with open(victim, "r+b") as f:
        f.truncate(4096)
    assert ckpts.latest() == ckpts.root / "step_00000004"
    (first, *rest) = _warnings(caplog)
    assert first == ("checkpoint step_00000006 is unusable: ds/mp_rank_00_model_states.pt is 4096 bytes, the "
                     "manifest says 1572864; falling back to an older one")
    assert rest == ["using step_00000004, the newest checkpoint that verifies"]
    assert ckpts.latest(verify="size") == ckpts.root / "step_00000004"  # a size check catches truncation


def test_flipped_bytes_of_the_same_size_are_caught_by_the_hash_only(tmp_path, log, caplog):
    ckpts = _save_steps(tmp_path, log)
    victim = ckpts.root / "step_00000006" / "ds" / "optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[500] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert ckpts.latest(verify="size") == ckpts.root / "step_00000006"  # same size: only the hash can tell
    assert ckpts.latest(verify="full") == ckpts.root / "step_00000004"
    assert "ds/optim_states.pt has sha256" in _warnings(caplog)[0]


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / MANIFEST).unlink(), "manifest.json is missing"),
    (lambda p: (p / MANIFEST).write_text('{"files": '), "manifest.json is unreadable (JSONDecodeError)"),
    (lambda p: (p / MANIFEST).write_text('{"files": {"meta.json": 3}}'), "manifest.json is unreadable (TypeError)"),
    (lambda p: (p / MANIFEST).write_text('{"files": {}}'), "manifest.json does not list meta.json"),
    (lambda p: (p / "rng_rank0.pt").unlink(), "rng_rank0.pt is missing"),
    (lambda p: (p / "meta.json").write_text("{}"), "meta.json is 2 bytes, the manifest says"),
])
def test_an_unsealed_or_incomplete_newest_is_skipped(tmp_path, log, caplog, damage, reason):
    ckpts = _save_steps(tmp_path, log)
    damage(ckpts.root / "step_00000006")
    assert ckpts.latest() == ckpts.root / "step_00000004"
    assert reason in _warnings(caplog)[0] and "step_00000006" in _warnings(caplog)[0]


def test_none_verifying_is_one_clear_error_not_a_fresh_start(tmp_path, log, caplog):
    ckpts = _save_steps(tmp_path, log)
    for d in ckpts.root.glob("step_*"):
        (d / "ds" / "optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as e:
        ckpts.latest()
    msg = str(e.value)
    assert "\n" not in msg and "none of the 3 checkpoint(s)" in msg
    assert "newest step_00000006: ds/optim_states.pt is 0 bytes, the manifest says 1000" in msg
    assert len(_warnings(caplog)) == 3  # one line per rejected checkpoint
    (ckpts.root / "latest").unlink()  # no pointer: the step dirs are still checkpoints the user must decide on
    with pytest.raises(CheckpointError):
        ckpts.latest()


def test_pointer_and_empty_run_dir_cases(tmp_path, log, caplog):
    ckpts = CheckpointManager(tmp_path / "fresh", log=log)
    assert ckpts.latest() is None  # nothing there: a fresh start, no warning
    ckpts = _save_steps(tmp_path / "run", log)
    (ckpts.root / "latest").write_text("step_00000004\n")  # moved back by hand: newer dirs are not considered
    assert ckpts.latest() == ckpts.root / "step_00000004"
    (ckpts.root / "latest").unlink()  # a crash before the first pointer: the newest that verifies, with a warning
    assert ckpts.latest() == ckpts.root / "step_00000006"
    assert "no latest pointer" in _warnings(caplog)[-1]
    (ckpts.root / "latest").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="not a step_XXXXXXXX name"):
        ckpts.latest()
    with pytest.raises(ValueError, match="verify must be one of"):
        ckpts.latest(verify="none")


def test_a_checkpoint_without_a_manifest_is_refused_whatever_its_meta_says(tmp_path, log):
    """No checkpoint predates manifests any more (the project has no runs from before them): a meta.json without
    "format" earns no exemption from verification."""
    ckpts = _save_steps(tmp_path, log, steps=(2,))
    path = ckpts.root / "step_00000002"
    (path / MANIFEST).unlink()
    meta = json.loads((path / "meta.json").read_text())
    del meta["format"]  # what the code before manifests wrote
    (path / "meta.json").write_text(json.dumps(meta))
    assert checkpoint_problem(path) == "manifest.json is missing"
    with pytest.raises(CheckpointError, match="step_00000002: manifest.json is missing"):
        ckpts.latest()


def test_load_refuses_a_truncated_checkpoint(tmp_path, log):
    ckpts = _save_steps(tmp_path, log, steps=(2,))
    path = ckpts.latest()
    (path / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"short")
    with pytest.raises(CheckpointError, match="ds/mp_rank_00_model_states.pt is 5 bytes"):
        ckpts.load(FakeEngine(), path, 0)


def test_prune_never_drops_the_fresh_checkpoint_for_a_newer_rejected_one(tmp_path, log):
    """A run resumed from step 4 past a corrupt step 6 with checkpoint.keep_last lowered to 1 (a change a resume
    may make): saving step 5 keeps step 5 (counting step 6 among the newest would have deleted it)."""
    _save_steps(tmp_path, log, steps=(4, 6), keep_last=2)
    ckpts = CheckpointManager(tmp_path, keep_last=1, log=log)
    (ckpts.root / "step_00000006" / MANIFEST).unlink()
    assert ckpts.latest() == ckpts.root / "step_00000004"
    ckpts.save(FakeEngine(5), 5, {"config": {}}, 0, lambda: None)
    assert sorted(p.name for p in ckpts.root.glob("step_*")) == ["step_00000005", "step_00000006"]
    assert ckpts.latest() == ckpts.root / "step_00000005"


def _meta(**changes) -> dict:
    """meta.json of a checkpoint whose config differs from the default by the dotted `changes`."""
    cfg = RunConfig().to_dict()
    cfg["loss"]["matmul_dtype"] = "bfloat16"  # a trainer saves its `auto` resolved (workers/trainer/precision.py)
    for key, value in changes.items():
        section, name = key.split(".")
        cfg[section][name] = value
    return {"config": cfg}


@pytest.mark.parametrize("key, old, message", [
    ("data.max_len", 256, "data.max_len is 512 now but 256 in the checkpoint"),
    ("data.anchors_per_seq", 8, "data.anchors_per_seq is 16 now but 8"),
    ("data.full_blocks_first", False, "data.full_blocks_first is True now but False"),
    ("loss.tv_weight", 0.5, "loss.tv_weight is 0.9 now but 0.5"),
    ("train.precision", "bf16", "train.precision is 'fp32' now but 'bf16'"),
    ("train.zero_stage", 3, "train.zero_stage is 2 now but 3"),
    ("train.lr", 1e-3, "train.lr is 0.0003 now but 0.001"),
    ("target.wire_dtype", "float32", "target.wire_dtype is 'bfloat16' now but 'float32'"),
    ("draft.num_layers", 2, "draft.num_layers is 1 now but 2"),
    ("loss.matmul_dtype", "float32", "loss.matmul_dtype is 'bfloat16' now but 'float32' in the checkpoint (pass "
                                     "loss.matmul_dtype=float32 to continue this run"),
])
def test_check_resume_refuses_a_change_of_data_or_model(key, old, message):
    now = RunConfig(loss=LossConfig(matmul_dtype="bfloat16"))  # explicit: `auto` keeps the checkpoint's value
    with pytest.raises(InputError) as e:
        check_resume(now, _meta(**{key: old}))
    assert message in str(e.value) and str(e.value).startswith("cannot resume: ") and "\n" not in str(e.value)


def test_check_resume_reads_a_missing_key_as_its_default():
    """A checkpoint whose config lacks a key (its code predates the key) ran with the key's default: it resumes
    with the default and is refused with another value, which would change its loss. (loss.matmul_dtype's default
    is `auto` now, which keeps what the checkpoint ran with: bfloat16, the default before `auto`.)"""
    meta = _meta()
    del meta["config"]["loss"]["matmul_dtype"]
    check_resume(RunConfig(), meta)
    with pytest.raises(InputError, match="loss.matmul_dtype is 'float32' now but 'bfloat16'"):
        check_resume(RunConfig(loss=LossConfig(matmul_dtype="float32")), meta)


def test_check_resume_compares_nested_draft_keys_and_global_batch():
    meta = _meta()
    meta["config"]["draft"]["moe"]["top_k"] = 1
    with pytest.raises(InputError, match="draft.moe.top_k is 2 now but 1"):
        check_resume(RunConfig(), meta)
    with pytest.raises(InputError, match=r"global batch .* is 2 feature batches per step now \(1 x 2\) but 4 in "
                                         r"the checkpoint \(2 x 2\)"):
        check_resume(RunConfig(), _meta(**{"train.grad_accum": 2}))
    check_resume(RunConfig(), _meta(**{"train.grad_accum": 2, "cluster.num_trainers": 1}))  # same global batch


def test_check_resume_allows_run_length_placement_and_filled_in_sizes():
    meta = _meta(**{"train.max_steps": 50, "train.log_every": 10, "checkpoint.run_dir": "/old/place",
                    "checkpoint.every_steps": 5, "target.num_workers": 4, "target.max_tokens_per_forward": 512,
                    "cluster.use_gpu": True, "cluster.max_failures": -1, "target.max_restarts": 0,
                    "target.batch_timeout_s": 60.0, "data.max_in_flight": 9, "loss.chunk_rows": 64,
                    "draft.vocab_size": 49152, "draft.hidden_size": 576, "draft.attn_impl": "gather"})
    check_resume(RunConfig(), meta)
    del meta["config"]["data"]["full_blocks_first"]  # a key the checkpoint's code did not have: its default
    check_resume(RunConfig(), meta)


@pytest.mark.slow
def test_single_process_resume_skips_a_truncated_newest_checkpoint(tmp_path):
    """Train 4 steps (checkpoints at 2 and 4), truncate step 4's weights, run 4 steps again: the run says which
    file is bad, resumes from step 2, and logs steps 3-4 with the losses of the first run (same data, state, RNG)."""
    from launch_helpers import TINY_MOE, run_launch

    from pipeline.metrics import read_jsonl_metrics

    run_dir = tmp_path / "run"
    args = ["--single-process", "--run-dir", str(run_dir), *TINY_MOE, "train.max_steps=4",
            "checkpoint.every_steps=2", "checkpoint.export=false", "train.lr=3e-3", "data.num_samples=32"]

    first = run_launch(args)
    assert first.returncode == 0, first.stderr[-4000:]
    losses = {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}
    ckpt = run_dir / "checkpoints"
    weights = ckpt / "step_00000004" / "ds" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    (run_dir / "metrics.jsonl").unlink()

    again = run_launch(args)
    assert again.returncode == 0, again.stderr[-4000:]
    assert (f"checkpoint step_00000004 is unusable: ds/model.safetensors is {size // 2} bytes, the manifest says "
            f"{size}; falling back to an older one") in again.stderr
    assert f"resuming from {ckpt / 'step_00000002'}" in again.stderr
    resumed = {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}
    assert sorted(resumed) == [3, 4]
    for s in (3, 4):
        assert resumed[s] == pytest.approx(losses[s], rel=1e-6, abs=1e-7), (s, resumed[s], losses[s])
    assert (ckpt / "latest").read_text().strip() == "step_00000004"
    assert checkpoint_problem(ckpt / "step_00000004") is None  # the bad checkpoint was replaced by a sealed one
    sealed = json.loads((ckpt / "step_00000004" / MANIFEST).read_text())["files"]
    assert {"ledger.parquet", "meta.json", "rng_rank0.pt", "ds/model.safetensors", "ds/optimizer.pt"} <= set(sealed)


def _reseal(path, name: str, data: bytes) -> None:
    """Replace a file of a committed checkpoint and seal it again: the manifest matches, the content is bad."""
    from workers.trainer.checkpoint import write_manifest

    (path / name).write_bytes(data)
    (path / MANIFEST).unlink()
    write_manifest(path)


@pytest.mark.parametrize("name, data, reason", [
    ("meta.json", b'{"step": 6, "config', "meta.json does not parse (JSONDecodeError)"),
    ("meta.json", b'{"config": {}}', "meta.json does not parse (KeyError)"),
    ("ledger.parquet", b"PAR1" + b"x" * 100, "ledger.parquet does not read (ArrowInvalid)"),
])
def test_a_sealed_checkpoint_that_does_not_parse_falls_back_like_any_other(tmp_path, log, caplog, name, data, reason):
    ckpts = _save_steps(tmp_path, log)
    _reseal(ckpts.root / "step_00000006", name, data)
    assert ckpts.latest() == ckpts.root / "step_00000004"
    assert _warnings(caplog) == [f"checkpoint step_00000006 is unusable: {reason}; falling back to an older one",
                                 "using step_00000004, the newest checkpoint that verifies"]


def test_a_complete_step_dir_newer_than_latest_is_named_not_used(tmp_path, log, caplog):
    ckpts = _save_steps(tmp_path, log)
    (ckpts.root / "latest").write_text("step_00000004\n")  # a crash between the rename and the pointer
    assert ckpts.latest() == ckpts.root / "step_00000004"
    assert _warnings(caplog) == [f"step_00000006 is complete but newer than step_00000004, which {ckpts.root}/latest "
                                 "names: not used (the pointer wins; write step_00000006 into it to resume from "
                                 "there)"]


class _Refused(Exception):
    pass


def test_a_fenced_out_trainer_commits_nothing_and_cleans_nothing(tmp_path, log):
    """Trainers of a driver whose lease was taken over (workers/lease.Fence.check_commit raises LeaseLost)."""
    from workers.lease import LeaseLost

    ckpts = _save_steps(tmp_path, log, steps=(2,))
    theirs = ckpts.root / "step_00000004.tmp"  # the new driver's save in progress
    theirs.mkdir()

    def fence():
        raise LeaseLost("checkpoint commit refused: run dir R was taken over")

    fenced = CheckpointManager(tmp_path, keep_last=1, log=log, fence=fence)
    with pytest.raises(LeaseLost):
        fenced.save(FakeEngine(4), 4, {"config": {}}, 0, lambda: None)
    assert theirs.is_dir() and (ckpts.root / "latest").read_text() == "step_00000002\n"
    assert sorted(p.name for p in ckpts.root.iterdir()) == ["latest", "step_00000002", "step_00000004.tmp"]

    calls = []  # passes the first check (the .tmp clean-up), refused at the commit: no rename, no latest, no prune
    fenced.fence = lambda: calls.append(1) if len(calls) < 1 else fence()
    with pytest.raises(LeaseLost):
        fenced.save(FakeEngine(6), 6, {"config": {}}, 0, lambda: None)
    assert (ckpts.root / "latest").read_text() == "step_00000002\n" and (ckpts.root / "step_00000002").is_dir()
    assert not (ckpts.root / "step_00000006").exists()


class _FullDisk(FakeEngine):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        from pathlib import Path

        (Path(save_dir) / tag).mkdir(parents=True)
        (Path(save_dir) / tag / "part").write_bytes(b"x" * (3 << 19))  # 1.5 MiB written before the disk filled
        raise self.error


FULL = "the disk is full (ENOSPC)", "free space"
WRITABLE = "make the run dir writable"


@pytest.mark.parametrize("error, what, todo", [
    (OSError(errno.ENOSPC, "No space left on device"), *FULL),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "the disk quota is exceeded (EDQUOT)",
     "free space or raise the quota"),
    (OSError(errno.EROFS, "Read-only file system"), "the file system is read-only (EROFS)", WRITABLE),
    (PermissionError(errno.EACCES, "Permission denied"), "permission is denied (EACCES)", f"{WRITABLE} for this user"),
    # safetensors' text, and torch.save's zip writer (no errno: the free space says)
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), *FULL),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"), *FULL),
])
def test_a_save_that_hits_a_full_disk_is_one_line_and_leaves_no_partial_dir(tmp_path, log, monkeypatch, error, what,
                                                                             todo):
    import shutil
    from collections import namedtuple

    from workers.trainer.checkpoint import StorageError

    ckpts = _save_steps(tmp_path, log, steps=(2,))
    need = sum(f["size"] for f in json.loads((ckpts.root / "step_00000002" / MANIFEST).read_text())["files"].values())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 << 30, 10 << 30, 0))
    with pytest.raises(StorageError) as info:
        ckpts.save(_FullDisk(error), 4, {"config": {}}, 0, lambda: None)
    assert str(info.value) == (f"cannot save checkpoint step_00000004 under {ckpts.root}: {what}; the last checkpoint, "
                               f"step_00000002, needed {need / 2**20:.1f} MiB, 0.0 MiB free now; removed the partial "
                               f"step_00000004.tmp; {todo}, then re-run the same command to resume from step_00000002")
    assert not (ckpts.root / "step_00000004.tmp").exists() and ckpts.latest() == ckpts.root / "step_00000002"


def test_the_first_checkpoint_on_a_full_disk_says_what_it_had_written(tmp_path, log):
    from workers.trainer.checkpoint import StorageError

    with pytest.raises(StorageError) as info:
        CheckpointManager(tmp_path, log=log).save(_FullDisk(OSError(errno.ENOSPC, "No space left on device")), 2,
                                                  {"config": {}}, 0, lambda: None)
    assert "the disk is full (ENOSPC); this first one had written 1.5 MiB when it failed, " in str(info.value)
    assert str(info.value).endswith("removed the partial step_00000002.tmp; free space, then re-run the same command")


def test_other_save_failures_are_not_storage_errors(tmp_path, log):
    """Left to Ray Train's restart as before (a peer died mid-save, a bug): only the cause is re-raised."""
    with pytest.raises(RuntimeError, match="^boom$"):
        CheckpointManager(tmp_path, log=log).save(_FullDisk(RuntimeError("boom")), 2, {"config": {}}, 0,
                                                  lambda: None)


def test_storage_and_lease_errors_are_reported_once_not_retried():
    """workers/trainer/ray_trainer.FATAL_ERRORS: recorded in RunControl, so the retried trainer group returns at once
    and the driver exits 1 with the line (tests/test_faults.py proves the mechanism through Ray Train)."""
    pytest.importorskip("ray")
    from workers.lease import LeaseLost
    from workers.trainer.checkpoint import StorageError
    from workers.trainer.ray_trainer import FATAL_ERRORS

    assert issubclass(StorageError, FATAL_ERRORS) and issubclass(LeaseLost, FATAL_ERRORS)


def test_a_write_outside_a_save_that_hits_a_full_disk_is_a_storage_error(tmp_path, log):
    """The metrics file or TensorBoard on a full disk: fatal like a save's (workers/trainer/ray_trainer.train_loop
    records it instead of letting Ray Train retry), judged by the errno alone: without one it is not a StorageError,
    whatever the free space."""
    from workers.trainer.checkpoint import StorageError

    ckpts = CheckpointManager(tmp_path, log=log)
    try:
        open(tmp_path / "metrics.jsonl", "a").write(1)  # noqa: SIM115 - a write error with no errno
    except TypeError as e:
        assert ckpts.write_failure(e) is None
    cause = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("flush failed") from cause
    except RuntimeError as e:
        failure = ckpts.write_failure(e)
    assert isinstance(failure, StorageError)
    assert str(failure).startswith(f"cannot write under {tmp_path}: the disk is full (ENOSPC): flush failed; "
                                   "free space, then re-run the same command")
    assert ckpts.write_failure(OSError(errno.EROFS, "Read-only file system")) is not None
    assert ckpts.write_failure(RuntimeError("unexpected pos 128 vs 0")) is None
