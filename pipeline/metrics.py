"""Where training metrics go: a small sink interface with JSONL, TensorBoard and null implementations,
and the one rank-aware logging helper of the project."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol

from pipeline.atomic import fsync_dir, write_text_atomic


def get_logger(name: str, rank: int | None = None) -> logging.Logger:
    """A logger whose lines carry the data-parallel rank, configured once per process."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        tag = f"[rank {rank}] " if rank is not None else ""
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("DSPARK_LOG_LEVEL", "INFO"))
        logger.propagate = False
    return logger


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def drop_log_message(logger_name: str, start: str) -> None:
    """Drop the records of a third-party logger whose message starts with `start` (one known-harmless message,
    matched by its text; every other record of that logger still prints). Once per process and message."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
        logger.addFilter(_DropMessage(start))


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def drop_rows_after(path: str | Path, step: int) -> int:
    """Cut a metrics.jsonl back to the rows of steps 1..`step`, and return how many rows went.

    A run resumed from the checkpoint of step S re-trains S+1, S+2, ...: the rows the crashed run wrote past S
    describe steps that no longer happened (another data order after an elastic resume, other random draws), and
    left in place they would give a plot two curves. The file is rewritten whole (pipeline/atomic.py: a reader
    sees the old file or the new one, never a mix), and only when something goes, so that every reader (pandas,
    jq, a plotting script) sees one row per step without knowing any rule of ours. A torn last line (the crash
    came mid-write) goes too: the next append would otherwise be glued onto it; so do the earlier rows of a step
    logged twice by a file from before this rule."""
    p = Path(path)
    if not p.is_file():
        return 0
    text = p.read_text()
    rows = [line for line in text.splitlines() if line.strip()]
    last: dict[int, int] = {}  # step -> index of its last row (files from before this rule repeat steps)
    for i, line in enumerate(rows):
        try:
            s = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line: not a row of ours
        if s <= step:
            last[s] = i
    kept = [rows[i] for i in sorted(last.values())]
    dropped = len(rows) - len(kept)
    if dropped or (text and not text.endswith("\n")):
        write_text_atomic(p, "".join(line + "\n" for line in kept))
        fsync_dir(p.parent)
    return dropped


class JsonlSink:
    """One JSON object per step, appended: a resumed run continues the same file. `resume_step` (the step of the
    checkpoint the run starts from, 0 for a fresh start) first drops the rows past it (`drop_rows_after`)."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            drop_rows_after(path, resume_step)
        self._f = open(path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    """Scalars per step. `resume_step` as for JsonlSink: the new event file opens with a purge event at
    resume_step + 1, which makes TensorBoard discard the events of steps from there on that earlier files hold
    (its data server also drops them on its own once a step is logged again; the purge covers the legacy loader
    and steps the resumed run has not reached yet)."""

    def __init__(self, log_dir: str | Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._w.add_scalar(k, v, step)

    def close(self) -> None:
        self._w.close()


class MultiSink:
    def __init__(self, *sinks: MetricsSink) -> None:
        self._sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for s in self._sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self._sinks:
            s.close()


def read_jsonl_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """The record of each step. A resume drops the rows past its checkpoint (`drop_rows_after`), so a step has
    one row; in a file written before that rule, the last record of a step wins (the re-trained one)."""
    out: dict[int, dict[str, float]] = {}
    p = Path(path)
    if p.is_file():
        for line in p.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[int(rec["step"])] = rec
    return out
