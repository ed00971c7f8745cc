"""The run's training samples on disk, read back by sample id.

The driver writes every sample of a run (whatever its source: the embedded corpus, a .jsonl file, a data-stage
Parquet) once into `<run_dir>/samples.parquet`; the feature service reads rows by id from it. So no actor holds
the dataset in its constructor arguments (Ray keeps those for a restart), a restarted service finds the same
samples, and their digest (`samples_digest`), recorded in every checkpoint and its ledger, ties the ledger's
sample ids to the exact token sequences they name.

Columns: sample_id int64, input_ids list<int32>, loss_mask list<bool>; row i holds sample_id i.

Scale (production data stages hold 10^6+ samples): the file is written a chunk of rows at a time
(`SamplesWriter`), its digest computed as the rows go by, and `SampleStore` decodes only the row groups that
hold the ids it is asked for, keeping a few in a small cache. Neither side ever holds the whole data set.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.contracts import TokenizedSample

SAMPLES_FILE = "samples.parquet"
# Rows per row group. SampleStore decodes a whole row group (pyarrow reads no finer) to take one of its rows, and
# a batch of random ids lands in about samples_per_batch different groups: small groups keep a batch's read near
# the size of its own rows. Values are stored plain (no dictionary), which decodes fastest. The footer grows by one
# entry per group and column, still small at 10^6 samples (docs/data_stage.md, "Scale").
ROW_GROUP_ROWS = 128
SCHEMA = pa.schema([("sample_id", pa.int64()), ("input_ids", pa.list_(pa.int32())),
                    ("loss_mask", pa.list_(pa.bool_()))])
_CHUNK = 4096  # samples per chunk when a list of samples is written or digested


def _digest_update(h, offsets: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> None:
    """Feed rows (row k = ids[offsets[k]:offsets[k+1]]) to `h`: per row its length (int64), its ids (int64) and
    its mask (bool), the byte stream `samples_digest` is defined by. Converted once per chunk, then sliced."""
    bounds = (np.asarray(offsets, dtype=np.int64) - int(offsets[0])).tolist()
    id_bytes = memoryview(np.ascontiguousarray(ids, dtype=np.int64)).cast("B")
    mask_bytes = memoryview(np.ascontiguousarray(mask, dtype=bool)).cast("B")
    lengths = memoryview(np.diff(np.asarray(offsets, dtype=np.int64))).cast("B")
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        h.update(lengths[8 * k:8 * k + 8])
        h.update(id_bytes[8 * a:8 * b])
        h.update(mask_bytes[a:b])


def _flat(samples: Sequence[TokenizedSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64 [n+1], ids int32 [T], mask bool [T]) of a list of samples."""
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if not len(samples):
        return offsets, np.zeros(0, np.int32), np.zeros(0, bool)
    ids = np.concatenate([np.asarray(s.input_ids, dtype=np.int32) for s in samples])
    mask = np.concatenate([np.asarray(s.loss_mask, dtype=bool) for s in samples])
    return offsets, ids, mask


def list_chunks(samples: Sequence[TokenizedSample]) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A list of samples as flat chunks of `_CHUNK` samples (see `_flat`)."""
    for lo in range(0, len(samples), _CHUNK):
        yield _flat(samples[lo:lo + _CHUNK])


class SamplesWriter:
    """Writes a samples file a chunk of rows at a time: sample ids assigned in order, the digest computed as the
    rows go by. Nothing is at `path` until `close()` (fsync, then an atomic rename); a failure removes the temp.

        with SamplesWriter(path) as w:
            w.write(offsets, ids, mask)     # as often as needed
        w.path, w.digest, w.num_samples
    """

    def __init__(self, path: str | os.PathLike, row_group_rows: int = ROW_GROUP_ROWS) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        self._writer = pq.ParquetWriter(self._tmp, SCHEMA, use_dictionary=False)
        self._rows = row_group_rows
        self._hash = hashlib.sha256()
        self.num_samples = 0
        self.digest = ""

    def write(self, offsets: np.ndarray, ids: np.ndarray, mask: np.ndarray) -> None:
        offsets = np.asarray(offsets, dtype=np.int64)
        n = len(offsets) - 1
        if n <= 0:
            return
        assert len(ids) == len(mask) == offsets[-1] - offsets[0], "ids, mask and offsets disagree"
        _digest_update(self._hash, offsets, ids, mask)
        rebased = pa.array((offsets - offsets[0]).astype(np.int32))
        table = pa.table({"sample_id": pa.array(np.arange(self.num_samples, self.num_samples + n, dtype=np.int64)),
                          "input_ids": pa.ListArray.from_arrays(rebased, pa.array(np.asarray(ids, dtype=np.int32))),
                          "loss_mask": pa.ListArray.from_arrays(rebased, pa.array(np.asarray(mask, dtype=bool)))},
                         schema=SCHEMA)
        self._writer.write_table(table, row_group_size=self._rows)
        self.num_samples += n

    def close(self) -> Path:
        self._writer.close()
        with open(self._tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(self._tmp, self.path)
        self.digest = self._hash.hexdigest()
        return self.path

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort() if exc_type is not None else self.close()


def write_samples(samples: Sequence[TokenizedSample], path: str | os.PathLike) -> Path:
    """Write `samples` (sample_id must equal the position) atomically to `path`; returns the path."""
    for i, s in enumerate(samples):
        if s.sample_id != i:
            raise ValueError(f"sample at position {i} has id {s.sample_id}: ids must be 0..N-1 in order")
    with SamplesWriter(path) as w:
        for chunk in list_chunks(samples):
            w.write(*chunk)
    return w.path


def samples_digest(samples: Sequence[TokenizedSample]) -> str:
    """sha256 of the samples' tokens and loss masks, in order (independent of the file format that holds them):
    per sample its length as int64, its ids as int64 and its mask as bool. `SamplesWriter.digest` is the same
    value for the same rows."""
    h = hashlib.sha256()
    for chunk in list_chunks(samples):
        _digest_update(h, *chunk)
    return h.hexdigest()


class SampleStore:
    """Rows of a samples.parquet by id, memory-mapped. Only the row groups that hold the ids asked for are
    decoded (the last `cache_groups` of them kept), so the reader's memory does not grow with the data set."""

    def __init__(self, path: str | os.PathLike, cache_groups: int = 64) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no samples file (the driver writes it before training starts)")
        self._file = pq.ParquetFile(self.path, memory_map=True)
        meta = self._file.metadata
        rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)])  # first row of each group, then N
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._cache_groups = cache_groups
        self._lock = threading.Lock()  # the feature service calls take from several threads

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _group(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets, ids, mask) of row group g, decoded once and cached."""
        if g in self._cache:
            self._cache.move_to_end(g)
            return self._cache[g]
        table = self._file.read_row_group(g, columns=["input_ids", "loss_mask"])
        ids, mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
        offsets = ids.offsets.to_numpy()
        assert np.array_equal(offsets, mask.offsets.to_numpy()), f"{self.path}: input_ids and loss_mask disagree"
        entry = (offsets, ids.values.to_numpy(), mask.values.to_numpy(zero_copy_only=False))
        self._cache[g] = entry
        while len(self._cache) > self._cache_groups:
            self._cache.popitem(last=False)
        return entry

    def take(self, sample_ids: Sequence[int]) -> list[TokenizedSample]:
        out = []
        with self._lock:
            for i in sample_ids:
                if not 0 <= i < len(self):
                    raise IndexError(f"sample id {i} outside 0..{len(self) - 1} of {self.path}")
                g = int(np.searchsorted(self._starts, i, side="right")) - 1
                offsets, ids, mask = self._group(g)
                a, b = offsets[i - self._starts[g]], offsets[i - self._starts[g] + 1]
                out.append(TokenizedSample(int(i), ids[a:b].astype(np.int64), mask[a:b].astype(bool)))
        return out
