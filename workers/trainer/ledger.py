"""The sample ledger: which samples every committed optimizer step trained, saved inside each checkpoint.

Every rank notes, per optimizer step, the feature batches it trained and the sample ids each batch really carried
(`FeatureBatch.sample_ids`, as received, not as recomputed). At a checkpoint the notes of all ranks are gathered on
rank 0 and written into the checkpoint directory as `ledger.parquet` before it is committed, so the ledger of
checkpoint N lists exactly the steps 1..N: a sample counts as trained when the checkpoint after its step is
committed, and nothing recorded is ever ahead of the checkpoint a resume starts from. The file is cumulative (all
steps since the start), so any one checkpoint proves its whole history even after older ones were pruned; at
about 16 bytes per trained sample before compression it stays small next to the optimizer state.

`audit` checks a ledger against the data order (pipeline/order.py): every batch index of the committed steps
present once, with the samples the order assigns to it, so each sample of an epoch trained exactly once.

Columns: step int64 (1-based: the optimizer step that trained it), batch_index int64, rank int32, world int32,
sample_ids list<int64>; the file's metadata holds the samples' sha256 (pipeline/sample_store.samples_digest).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.order import batch_sample_ids, batches_per_epoch

LEDGER_FILE = "ledger.parquet"
Row = tuple[int, int, int, int, tuple[int, ...]]  # (step, batch_index, rank, world, sample_ids)


class Ledger:
    """This rank's uncommitted rows, and (on rank 0) the committed history they are appended to."""

    def __init__(self, committed: list[Row] | None = None, samples_digest: str = "") -> None:
        self.committed: list[Row] = list(committed or [])
        self.pending: list[Row] = []
        self.samples_digest = samples_digest

    def record(self, step: int, batch_index: int, rank: int, world: int, sample_ids: tuple[int, ...]) -> None:
        self.pending.append((step, batch_index, rank, world, tuple(int(i) for i in sample_ids)))

    def commit(self, gathered: list[list[Row]]) -> list[Row]:
        """Append every rank's pending rows (rank 0, at a checkpoint); returns the full history to write."""
        new = sorted((r for rows in gathered for r in rows), key=lambda r: (r[0], r[1]))
        self.committed.extend(new)
        self.pending = []
        return self.committed

    def drop_pending(self) -> None:
        self.pending = []


def write_ledger(rows: list[Row], path: str | os.PathLike, samples_digest: str) -> None:
    cols = list(zip(*rows)) if rows else [[], [], [], [], []]
    table = pa.table({"step": pa.array(cols[0], pa.int64()), "batch_index": pa.array(cols[1], pa.int64()),
                      "rank": pa.array(cols[2], pa.int32()), "world": pa.array(cols[3], pa.int32()),
                      "sample_ids": pa.array([list(s) for s in cols[4]], pa.list_(pa.int64()))})
    table = table.replace_schema_metadata({"samples_digest": samples_digest})
    pq.write_table(table, path)


def read_ledger(path: str | os.PathLike) -> tuple[list[Row], str]:
    """(rows, samples_digest) of a ledger file."""
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    d = table.to_pydict()
    rows = [(s, b, r, w, tuple(ids)) for s, b, r, w, ids in
            zip(d["step"], d["batch_index"], d["rank"], d["world"], d["sample_ids"])]
    return rows, meta.get(b"samples_digest", b"").decode()


@dataclass(frozen=True)
class Audit:
    steps: int  # committed optimizer steps
    batches: int  # feature batches the ledger records
    samples_trained: int  # sample occurrences trained
    duplicates: int  # occurrences beyond the first of an (epoch, sample id)
    lost: int  # (epoch, sample id) pairs the data order assigns to the committed steps but the ledger lacks
    wrong: int  # batches whose samples differ from what the data order assigns to their index

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.lost == 0 and self.wrong == 0

    def line(self) -> str:
        return (f"ledger: {self.steps} steps, {self.batches} batches, {self.samples_trained} samples trained, "
                f"duplicates={self.duplicates} lost={self.lost} wrong={self.wrong}")


def audit(rows: list[Row], num_samples: int, samples_per_batch: int, seed: int, batches_per_step: int) -> Audit:
    """Check the ledger's rows against the data order: steps 1..S must have trained exactly the batches
    0..S*batches_per_step-1 (batches_per_step = grad_accum x trainers, kept fixed across world sizes), each once,
    each with its assigned samples. (With data.replay_batches the trainers see replayed batches by design, so
    such a run's ledger does not audit clean.)"""
    steps = max((r[0] for r in rows), default=0)
    per_epoch = batches_per_epoch(num_samples, samples_per_batch)
    seen_samples: dict[tuple[int, int], int] = {}
    wrong = 0
    for _step, b, _rank, _world, ids in rows:
        if list(ids) != batch_sample_ids(b, num_samples, samples_per_batch, seed):
            wrong += 1
        for i in ids:
            key = (b // per_epoch, i)
            seen_samples[key] = seen_samples.get(key, 0) + 1
    expected = set()
    for b in range(steps * batches_per_step):
        expected.update((b // per_epoch, i) for i in batch_sample_ids(b, num_samples, samples_per_batch, seed))
    duplicates = sum(n - 1 for n in seen_samples.values() if n > 1)
    lost = len(expected - seen_samples.keys())
    return Audit(steps=steps, batches=len(rows), samples_trained=sum(len(r[4]) for r in rows),
                 duplicates=duplicates, lost=lost, wrong=wrong)


def audit_checkpoint(checkpoint_dir: str | os.PathLike) -> Audit:
    """Audit the ledger of a committed checkpoint against the data settings in its meta.json."""
    import json

    d = Path(checkpoint_dir)
    meta = json.loads((d / "meta.json").read_text())
    cfg, pos = meta["config"], meta["data_position"]
    rows, _ = read_ledger(d / LEDGER_FILE)
    return audit(rows, int(pos["num_samples"]), cfg["data"]["samples_per_batch"], cfg["data"]["seed"],
                 int(pos["grad_accum"]) * int(pos["world_size"]))


def main(argv: list[str] | None = None) -> int:
    """python -m workers.trainer.ledger RUN_DIR_OR_CHECKPOINT: audit a run's latest checkpoint (or the one given)."""
    import sys

    from workers.trainer.checkpoint import CheckpointManager

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.trainer.ledger RUN_DIR_OR_CHECKPOINT_DIR", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        ckpt = path if (path / "meta.json").is_file() else CheckpointManager(path).latest()
        if ckpt is None or not (ckpt / LEDGER_FILE).is_file():
            print(f"error: no checkpoint with a {LEDGER_FILE} at {path}", file=sys.stderr)
            return 2
        result = audit_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - unreadable in any way (permissions, a bad file): one line, not a traceback
        text = str(e).strip().splitlines()
        print(f"error: cannot audit {path}: {type(e).__name__}{': ' + text[0] if text else ''}", file=sys.stderr)
        return 2
    print(f"{ckpt}: {result.line()}")
    return 0 if result.exactly_once else 1


if __name__ == "__main__":
    raise SystemExit(main())
