"""Data files as their readers see them: `x.jsonl.gz` and `x.jsonl.zst` are the JSONL they hold.

    with open_data("prompts.jsonl.zst") as f:   # a binary file of the decompressed bytes, buffered (peek works)
        for line in f: ...
    data_suffix("prompts.jsonl.zst") == ".jsonl"; data_stem("prompts.jsonl.zst") == "prompts"

Large JSONL data sets are commonly kept compressed. Every reader of a user's data file (the training data source,
the data stage's inputs, the evaluator's prompt files) opens it here, so a compressed file is never read as text. A
damaged stream (a truncated or corrupt file) is a ValueError naming the file, raised where the reading hits it;
zstandard's own stream reader returns a truncated file's bytes without complaint, hence the frame check below.
"""

from __future__ import annotations

import gzip
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}


def data_suffix(path: str | os.PathLike) -> str:
    """The format's suffix under any compression: ".jsonl" for x.jsonl, x.jsonl.gz and x.jsonl.zst."""
    p = Path(path)
    return Path(p.stem).suffix if p.suffix in COMPRESSIONS else p.suffix


def data_stem(path: str | os.PathLike) -> str:
    """The file's name without its format and compression suffixes: "gsm8k" for gsm8k.jsonl and gsm8k.jsonl.zst."""
    name = Path(path).name
    if Path(name).suffix in COMPRESSIONS:
        name = Path(name).stem
    return Path(name).stem


def check_stream(path: str | os.PathLike) -> None:
    """Decompress the whole file once, reading nothing into memory: ValueError naming it where it is damaged. For
    readers that hand the file to a library (the data stage's `datasets`), so that a damaged file stops the run
    before any work rather than in the library's middle."""
    if Path(path).suffix in COMPRESSIONS:
        with open_data(path) as f:
            while f.read(1 << 20):
                pass


class _ZstdReader(io.RawIOBase):
    """A zstd file's decompressed bytes, frame after frame; EOFError when the file ends inside a frame."""

    def __init__(self, raw: BinaryIO) -> None:
        import zstandard

        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._d, self._pending, self._started = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            data = self._raw.read(1 << 16)
            if not data:
                if self._started and not self._d.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while data:  # one chunk may end a frame and start the next
                if self._d.eof:
                    self._d = self._new()
                self._started = True
                self._pending += self._d.decompress(data)
                data = self._d.unused_data if self._d.eof else b""
        n = min(len(buf), len(self._pending))
        buf[:n], self._pending = self._pending[:n], self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


@contextmanager
def open_data(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed by its suffix (.gz, .zst). ValueError naming the file when the compressed
    stream is damaged."""
    p = Path(path)
    kind = COMPRESSIONS.get(p.suffix)
    if kind is None:
        with open(p, "rb") as f:
            yield f
        return
    import zstandard

    try:
        f = gzip.open(p, "rb") if kind == "gzip" else io.BufferedReader(_ZstdReader(open(p, "rb")))
        with f:
            yield f
    except (OSError, EOFError, zstandard.ZstdError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"data file {p} is not a readable {kind} file ({type(e).__name__}: "
                         f"{str(e).strip() or 'damaged'}); it must hold JSON lines compressed with {kind}") from None
