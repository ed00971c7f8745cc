"""A data-stage Parquet source (launch/prepare_data.py's directory, or one .parquet file) for the driver, read one
record batch at a time: the driver never holds the data set, only one batch of rows and a few numbers.

`ParquetSamples` selects the training rows (rows longer than max_len dropped, never truncated, and counted in the
log; the first num_samples of the rest kept, in row order, sample_id = position) and scans them once when built:
how many there are, how many have a trainable block, which token ids occur (for the mask-token check). `chunks()`
reads them again, in the same order, for the run's samples file (pipeline/sample_store.py); `load_parquet_corpus`
is the same selection as a list, for callers that hold the data set.
Everything per row is numpy over the batch's flat arrays; nothing loops over rows in Python.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.contracts import TokenizedSample
from pipeline.data.rows import check_row_lengths, check_token_columns, shard_files, unreadable

log = logging.getLogger(__name__)

BATCH_ROWS = 4096  # rows decoded at a time


def flat(ids: pa.ListArray, mask: pa.ListArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64 [n+1] from 0, ids [T], mask bool [T]) of a batch's two list columns (equal lengths: the
    reader checked them, `check_row_lengths`)."""
    offsets = ids.offsets.to_numpy().astype(np.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])
    return (offsets - lo, ids.values.to_numpy()[lo:hi],
            mask.values.to_numpy(zero_copy_only=False)[lo:hi].astype(bool, copy=False))


def trainable_rows(offsets: np.ndarray, mask: np.ndarray) -> int:
    """Rows with at least 2 tokens and a loss-masked token after their first (what a block can train on)."""
    cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    starts, ends = offsets[:-1], offsets[1:]
    after_first = cum[ends] - cum[np.minimum(starts + 1, ends)]
    return int(np.count_nonzero((ends - starts >= 2) & (after_first > 0)))


class ParquetSamples:
    """The training samples of a data-stage source, scanned once, read again by `chunks()`; len() is the count."""

    def __init__(self, path: str | os.PathLike, max_len: int | None = None, num_samples: int | None = None) -> None:
        self.path, self.max_len, self.num_samples = path, max_len, num_samples
        self.files = shard_files(path)
        self.too_long = 0
        self.trainable = 0
        self._count = 0
        self._present = np.zeros(0, dtype=bool)  # token id -> occurs in some sample
        for offsets, ids, mask in self.chunks(_scan=True):
            self._count += len(offsets) - 1
            self.trainable += trainable_rows(offsets, mask)
            if len(ids):
                if ids.min() < 0:
                    raise ValueError(f"data {path}: negative token id {int(ids.min())}")
                seen = np.bincount(ids) > 0
                if len(seen) > len(self._present):
                    seen[:len(self._present)] |= self._present
                    self._present = seen
                else:
                    self._present[:len(seen)] |= seen
        if self.too_long:
            log.warning("data %s: dropped %d rows longer than %d tokens", path, self.too_long, max_len)
        if not self._count:
            raise ValueError(f"data {path} has no samples" + (f" of at most {max_len} tokens" if self.too_long
                                                                else ""))

    def __len__(self) -> int:
        return self._count

    def holds_token(self, token_id: int) -> bool:
        """Whether any sample holds `token_id` (from the scan; no read)."""
        return 0 <= token_id < len(self._present) and bool(self._present[token_id])

    def __iter__(self) -> Iterator[TokenizedSample]:
        """One sample at a time (a loop over rows: for the rare caller that needs them, e.g. naming the sample
        that holds a token)."""
        position = 0
        for offsets, ids, mask in self.chunks():
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                yield TokenizedSample(position, ids[a:b].copy(), mask[a:b].copy())
                position += 1

    def chunks(self, _scan: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The selected rows in order as flat (offsets, ids int32, mask bool) batches (see `flat`)."""
        left = self.num_samples
        for f in self.files:
            if _scan:  # one-line refusals naming the file, before anything is decoded
                check_token_columns(f)
            first_row = 0
            for batch in self._batches(f):
                if left is not None and left <= 0:
                    return
                ids, mask = batch.column("input_ids"), batch.column("loss_mask")
                if _scan:
                    check_row_lengths(f, first_row, ids.offsets.to_numpy(), mask.offsets.to_numpy())
                first_row += len(ids)
                keep = None
                if self.max_len is not None:
                    keep = pc.less_equal(pc.list_value_length(ids), self.max_len).to_numpy(zero_copy_only=False)
                if left is not None:  # the rows up to the left-th kept one (the rest are never reached)
                    kept_at = np.flatnonzero(keep) if keep is not None else np.arange(len(ids))
                    if len(kept_at) > left:
                        end = int(kept_at[left - 1]) + 1 if left else 0
                        ids, mask = ids.slice(0, end), mask.slice(0, end)
                        keep = keep[:end] if keep is not None else None
                if keep is not None and not keep.all():
                    if _scan:
                        self.too_long += int(len(keep) - keep.sum())
                    ids, mask = ids.filter(pa.array(keep)), mask.filter(pa.array(keep))
                if left is not None:
                    left -= len(ids)
                if len(ids):
                    yield flat(ids, mask)

    @staticmethod
    def _batches(f) -> Iterator[pa.RecordBatch]:
        try:
            reader = pq.ParquetFile(f, memory_map=True)
            yield from reader.iter_batches(batch_size=BATCH_ROWS, columns=["input_ids", "loss_mask"])
        except (pa.ArrowException, OSError) as e:
            raise unreadable(f, e) from None


def load_parquet_corpus(path: str | os.PathLike, max_len: int | None = None,
                        num_samples: int | None = None) -> list[TokenizedSample]:
    """ParquetSamples' rows as a list of TokenizedSample (ids as stored: int32): a file that is not the data stage's
    layout is a ValueError naming it, a row whose mask and ids differ in length one naming the row."""
    return list(ParquetSamples(path, max_len=max_len, num_samples=num_samples))
