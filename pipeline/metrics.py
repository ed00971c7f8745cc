"""Where training metrics go: a small sink interface with JSONL, TensorBoard and null implementations,
and the one rank-aware logging helper of the project."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol


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


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per step, appended (a resumed run continues the same file)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(log_dir))

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
    """Last record per step (a resumed run re-logs the steps after its checkpoint)."""
    out: dict[int, dict[str, float]] = {}
    p = Path(path)
    if p.is_file():
        for line in p.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[int(rec["step"])] = rec
    return out
