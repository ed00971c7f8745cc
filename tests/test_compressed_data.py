"""Compressed JSONL data files (.jsonl.gz, .jsonl.zst) are read as the JSON lines they hold by every reader of a
user's data: the training data source, the data stage's inputs and the evaluator's prompt files; a damaged one is
a ValueError naming the file (pipeline/data/compressed.py).

Run: python -m pytest tests/test_compressed_data.py -q
"""

from __future__ import annotations

import gzip
import json

import pytest
import zstandard

from evaluation.prompts import resolve_prompt_sets
from pipeline.data.compressed import data_stem, data_suffix, open_data
from pipeline.data.corpus import read_json_records
from pipeline.data.rows import open_prompts

RECORDS = [{"text": f"record {i} " + "x" * (i % 97)} for i in range(3000)]  # several zstd blocks
JSONL = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.fixture
def files(tmp_path):
    half = len(JSONL) // 2
    cut = JSONL.rindex(b"\n", 0, half) + 1
    two_frames = zstandard.ZstdCompressor().compress(JSONL[:cut]) + zstandard.ZstdCompressor().compress(JSONL[cut:])
    return {
        "plain": _write(tmp_path / "data.jsonl", JSONL),
        "gzip": _write(tmp_path / "data.jsonl.gz", gzip.compress(JSONL)),
        "zstd": _write(tmp_path / "data.jsonl.zst", zstandard.ZstdCompressor(level=3).compress(JSONL)),
        "zstd, two frames": _write(tmp_path / "frames.jsonl.zst", two_frames),
    }


@pytest.mark.parametrize("kind", ["plain", "gzip", "zstd", "zstd, two frames"])
def test_every_reader_reads_the_records_a_compressed_file_holds(files, kind):
    path = files[kind]
    assert [r for _, r in read_json_records(path)] == RECORDS
    assert [where for where, _ in read_json_records(path)][-1] == f"line {len(RECORDS)}"
    assert open_prompts([str(path)])["text"] == [r["text"] for r in RECORDS]
    assert resolve_prompt_sets([str(path)], 4) == {data_stem(path): [r["text"] for r in RECORDS[:4]]}


def test_names_under_compression():
    assert [data_suffix(n) for n in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst", "a.parquet")] == [".jsonl"] * 3 + [
        ".parquet"]
    assert [data_stem(n) for n in ("gsm8k.jsonl", "gsm8k.jsonl.zst", "gsm8k.jsonl.gz")] == ["gsm8k"] * 3


DAMAGED = {  # name: (file name, bytes, what the error says after "data file PATH ")
    "truncated zstd": ("cut.jsonl.zst", lambda: zstandard.ZstdCompressor().compress(JSONL)[:100],
                       "is not a readable zstd file (EOFError: the file ends inside a zstd frame)"),
    "not zstd": ("fake.jsonl.zst", lambda: JSONL[:200], "is not a readable zstd file (ZstdError: "),
    "truncated gzip": ("cut.jsonl.gz", lambda: gzip.compress(JSONL)[:100], "is not a readable gzip file (EOFError: "),
    "not gzip": ("fake.jsonl.gz", lambda: JSONL[:200], "is not a readable gzip file (BadGzipFile: "),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_a_damaged_compressed_file_is_named_by_every_reader(tmp_path, name):
    file_name, data, needle = DAMAGED[name]
    path = _write(tmp_path / file_name, data())
    for read in (lambda: list(read_json_records(path)), lambda: open_prompts([str(path)]),
                 lambda: resolve_prompt_sets([str(path)], 4)):
        with pytest.raises(ValueError) as e:
            read()
        assert str(e.value).startswith(f"data file {path} {needle}"), str(e.value)


def test_the_stream_reader_is_buffered_and_peekable(files):
    with open_data(files["zstd"]) as f:
        assert f.peek(1).startswith(b'{"text": "record 0 ')
        assert f.readline() == JSONL[:JSONL.index(b"\n") + 1]
