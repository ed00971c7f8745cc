"""The run's training samples on disk, read back by sample id.

The driver writes every sample of a run (whatever its source: the embedded corpus, a .jsonl file, a data-stage
Parquet) once into `<run_dir>/samples.parquet`; the feature service reads rows by id from it. So no actor holds
the dataset in its constructor arguments (Ray keeps those for a restart), a restarted service finds the same
samples, and their digest (`samples_digest`), recorded in every checkpoint and its ledger, ties the ledger's
sample ids to the exact token sequences they name.

Columns: sample_id int64, input_ids list<int32>, loss_mask list<bool>; row i holds sample_id i.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.contracts import TokenizedSample

SAMPLES_FILE = "samples.parquet"


def write_samples(samples: Sequence[TokenizedSample], path: str | os.PathLike) -> Path:
    """Write `samples` (sample_id must equal the position) atomically to `path`; returns the path."""
    for i, s in enumerate(samples):
        if s.sample_id != i:
            raise ValueError(f"sample at position {i} has id {s.sample_id}: ids must be 0..N-1 in order")
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    ids = pa.array(np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples]))
    mask = pa.array(np.concatenate([np.asarray(s.loss_mask, dtype=bool) for s in samples]))
    table = pa.table({"sample_id": pa.array(np.arange(len(samples), dtype=np.int64)),
                      "input_ids": pa.ListArray.from_arrays(offsets, ids),
                      "loss_mask": pa.ListArray.from_arrays(offsets, mask)})
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=4096)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def samples_digest(samples: Sequence[TokenizedSample]) -> str:
    """sha256 of the samples' tokens and loss masks, in order (independent of the file format that holds them)."""
    h = hashlib.sha256()
    for s in samples:
        ids = np.asarray(s.input_ids, dtype=np.int64)
        h.update(np.int64(len(ids)).tobytes())
        h.update(ids.tobytes())
        h.update(np.asarray(s.loss_mask, dtype=bool).tobytes())
    return h.hexdigest()


class SampleStore:
    """Rows of a samples.parquet by id, memory-mapped (the OS page cache holds what is read)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no samples file (the driver writes it before training starts)")
        table = pq.read_table(self.path, memory_map=True)
        ids, mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        self._offsets = ids.offsets.to_numpy()
        self._ids = ids.values.to_numpy()
        self._mask = mask.values.to_numpy(zero_copy_only=False)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def take(self, sample_ids: Sequence[int]) -> list[TokenizedSample]:
        out = []
        for i in sample_ids:
            if not 0 <= i < len(self):
                raise IndexError(f"sample id {i} outside 0..{len(self) - 1} of {self.path}")
            a, b = self._offsets[i], self._offsets[i + 1]
            out.append(TokenizedSample(int(i), self._ids[a:b].astype(np.int64), self._mask[a:b].astype(bool)))
        return out
