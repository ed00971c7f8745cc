"""The data path's scaling fixes (issue #21, item 9), in process and in seconds: the driver streams a data-stage
source instead of holding it (same rows, same digest, same checks as the in-memory loader), the feature service's
sample store decodes only the row groups it needs, the batch order computes one permutation per epoch, and the
mask-token check of a streamed source is a lookup, not a loop over samples. The figures are bench/data_scale.py's.

Run: python -m pytest tests/test_data_scale.py -q
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pyarrow.parquet as pq
import pytest
from data_scale import build_data_stage

from pipeline import order
from pipeline.contracts import TokenizedSample
from pipeline.data import parquet_source
from pipeline.data.parquet_source import ParquetSamples, load_parquet_corpus, trainable_rows
from pipeline.data.rows import shard_files
from pipeline.mask_token import check_mask_token
from pipeline.sample_store import SampleStore, samples_digest, write_samples
from workers.inputs import write_run_samples


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    out = tmp_path_factory.mktemp("stage") / "data"
    build_data_stage(out, 300, shard_rows=128, seed=3)  # 3 shards, lengths 16..8192
    return out


def _reference_rows(path, max_len, num_samples) -> list[TokenizedSample]:
    """The selection rule written the plain way (whole files, one row at a time): rows longer than max_len dropped,
    the first num_samples of the rest kept, in row order, sample_id = position."""
    out = []
    for f in shard_files(path):
        table = pq.read_table(f, columns=["input_ids", "loss_mask"])
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            if (max_len is None or len(ids) <= max_len) and (num_samples is None or len(out) < num_samples):
                out.append(TokenizedSample(len(out), np.array(ids, dtype=np.int64), np.array(mask, dtype=bool)))
    return out


def _reference_digest(samples) -> str:
    """The digest as first defined (one sample at a time): checkpoints made before the streaming writer hold it."""
    h = hashlib.sha256()
    for s in samples:
        ids = np.asarray(s.input_ids, dtype=np.int64)
        h.update(np.int64(len(ids)).tobytes())
        h.update(ids.tobytes())
        h.update(np.asarray(s.loss_mask, dtype=bool).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("max_len,num_samples", [(None, None), (600, None), (600, 150), (8192, 7), (300, 1)])
def test_streamed_source_selects_the_reference_rows(stage, monkeypatch, caplog, max_len, num_samples):
    monkeypatch.setattr(parquet_source, "BATCH_ROWS", 50)  # several batches per shard, the cap inside one
    want = _reference_rows(stage, max_len, num_samples)
    with caplog.at_level(logging.WARNING):
        got = ParquetSamples(stage, max_len=max_len, num_samples=num_samples)
        listed = load_parquet_corpus(stage, max_len=max_len, num_samples=num_samples)
    dropped = [r.message for r in caplog.records if "longer than" in r.message]
    assert len(got) == len(listed) == len(want) and len(set(dropped)) <= 1 and len(dropped) in (0, 2)
    for a, b, c in zip(got, listed, want, strict=True):
        assert a.sample_id == b.sample_id == c.sample_id
        assert np.array_equal(a.input_ids, c.input_ids) and np.array_equal(a.loss_mask, c.loss_mask)
        assert np.array_equal(b.input_ids, c.input_ids) and np.array_equal(b.loss_mask, c.loss_mask)
    assert got.trainable == sum(1 for s in want if len(s.input_ids) >= 2 and s.loss_mask[1:].any())
    used = np.unique(np.concatenate([s.input_ids for s in want]))
    assert all(got.holds_token(int(t)) for t in used[:50])
    assert not got.holds_token(5) and not got.holds_token(10**6)  # below FIRST_ID, beyond the vocabulary


def test_streamed_source_reads_only_token_columns(stage, monkeypatch):
    columns = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        columns.append(tuple(kwargs.get("columns") or ()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    ParquetSamples(stage, max_len=8192)
    assert columns and set(columns) == {("input_ids", "loss_mask")}  # never row_id, prompt or response


def test_trainable_rows_is_the_per_sample_rule():
    rows = [[0, 1, 1], [1], [1, 0], [0, 0, 0, 1], [], [0, 1]]
    offsets = np.cumsum([0] + [len(r) for r in rows])
    mask = np.array([bool(x) for r in rows for x in r])
    assert trainable_rows(offsets, mask) == sum(1 for r in rows if len(r) >= 2 and any(r[1:])) == 3


def test_run_samples_file_and_digest_are_the_same_from_a_list_or_a_stream(stage, tmp_path):
    listed = _reference_rows(stage, 1000, None)
    path_a, digest_a = write_run_samples(listed, tmp_path / "a")
    path_b, digest_b = write_run_samples(ParquetSamples(stage, max_len=1000), tmp_path / "b")
    assert digest_a == digest_b == samples_digest(listed) == _reference_digest(listed)
    assert pq.read_table(path_a).equals(pq.read_table(path_b))
    assert not list((tmp_path / "b").glob("*.tmp"))


def test_sample_store_decodes_only_the_row_groups_it_needs(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    samples = [TokenizedSample(i, rng.integers(0, 1000, size=3 + i % 7), rng.random(3 + i % 7) < 0.5)
               for i in range(5000)]
    path = write_samples(samples, tmp_path / "samples.parquet")
    assert pq.ParquetFile(path).metadata.num_row_groups == 40  # 128 rows a group
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: reads.append(g) or real(self, g, **kw))
    store = SampleStore(path, cache_groups=2)
    assert len(store) == 5000 and reads == []  # opening reads the footer only
    ids = [4999, 3, 128, 127, 255, 4998]
    for got, i in zip(store.take(ids), ids, strict=True):
        assert got.sample_id == i and np.array_equal(got.input_ids, samples[i].input_ids)
        assert np.array_equal(got.loss_mask, samples[i].loss_mask)
    assert reads == [39, 0, 1, 39]  # decoded once while cached; 2 kept, so group 39 was evicted by 1
    assert len(store._cache) == 2


def test_batch_order_is_unchanged_and_one_permutation_per_epoch():
    order.epoch_order.cache_clear()
    n, spb, seed = 1003, 8, 5
    per_epoch = order.batches_per_epoch(n, spb)
    for b in range(2 * per_epoch + 3):
        e, j = divmod(b, per_epoch)
        want = np.random.default_rng([seed, e]).permutation(n)[j * spb:(j + 1) * spb].tolist()
        assert order.batch_sample_ids(b, n, spb, seed) == want
    assert order.epoch_order.cache_info().misses == 3  # epochs 0, 1, 2


def test_mask_token_check_of_a_streamed_source_is_a_lookup(stage, monkeypatch):
    class Tok:
        bos_token_id = eos_token_id = pad_token_id = unk_token_id = None
        chat_template = None

        def convert_ids_to_tokens(self, i):
            return f"<{i}>"

    samples = ParquetSamples(stage, max_len=8192)
    monkeypatch.setattr(ParquetSamples, "__iter__", lambda self: pytest.fail("looped over samples"))
    check_mask_token(5, Tok(), samples)  # no sample holds id 5: answered from the scan
    monkeypatch.undo()
    held = int(next(iter(samples)).input_ids[0])
    with pytest.raises(ValueError, match=f"mask_token_id={held} occurs in training sample 0"):
        check_mask_token(held, Tok(), samples)
