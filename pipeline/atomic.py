"""Crash-safe file primitives: small-file writes that readers never see half-done (write a sibling, fsync,
rename over the target), directory fsyncs that make renames and new entries durable, and a streaming sha256."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HASH_CHUNK = 1 << 20  # 1 MiB reads: large enough for full disk throughput, small enough to stream any file


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the directory's entries (files created, renamed or removed in it) durable. A rename is only on disk
    once its directory is fsynced; without it a power cut can leave the old name or neither."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike, fsync: bool = False) -> tuple[int, str]:
    """(size in bytes, hex sha256) of a file, read in 1 MiB chunks. `fsync=True` also flushes the file's data to
    disk through the same descriptor (on Linux an fsync of a read-only descriptor flushes the inode's dirty pages,
    whoever wrote them), so a checkpoint's files can be made durable by the process that hashes them."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()
