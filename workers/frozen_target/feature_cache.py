"""The feature cache: the target's features of every training sample, written once, read back instead of running
the target again (`data.feature_cache`, opt-in; online streaming stays the default).

What is stored is exactly what a FeatureBatch carries for a sample, in the wire dtype: the context features
(`ctx`, [L, F]; [L, 0] when the context is the final state) and the pre-LM-head final state (`final`, [L, D]), one
safetensors file per sample under `<root>/<key>/<sample_id // 1000>/<sample_id>.safetensors`. Token ids and loss
masks are not stored: they come from the run's samples file, as for a streamed batch. `<key>` hashes everything
the features depend on: the samples file's digest, the target (its path, config.json and weight files' names and
sizes), the context layers and both dtypes. So a second epoch, a resumed run, or another draft of the same
target with the same context layers reads the same files, and anything else gets its own directory.

Exactness: a batch read back holds the very values the target worker shipped when it first encoded those samples.
A streamed later epoch encodes them again inside other batches, whose padding and grouping may move the last bit
of a float before the wire dtype's rounding; tests/test_feature_cache.py bounds that difference on the loss.

Writers are target workers (rank 0 of a target group), one file per sample, written to a temporary name and
renamed into place, so a reader never sees half a file and two writers of one sample leave one whole file. The
cache lives on storage every target worker and trainer can read (a shared filesystem on a multi-node cluster).
Legend: L tokens of one sample, F context feature width, D hidden size, T tokens of a batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pipeline.contracts import FeatureBatch, TokenizedSample

FORMAT = 1


def target_identity(target_path: str | os.PathLike) -> dict[str, Any]:
    """What identifies a target's weights without reading them: its resolved path, the hash of its config.json and
    the names and sizes of its weight files (a .gguf file: its name and size)."""
    p = Path(target_path).resolve()
    if p.is_file():
        return {"path": str(p), "files": [[p.name, p.stat().st_size]]}
    config = p / "config.json"
    return {"path": str(p),
            "config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None,
            "files": sorted([f.name, f.stat().st_size] for f in p.glob("*.safetensors"))}


def cache_key(samples_digest: str, target_path: str | os.PathLike, layers: list[int], dtype: str,
              wire_dtype: str) -> dict[str, Any]:
    return {"format": FORMAT, "samples_digest": samples_digest, "target": target_identity(target_path),
            "layers": [int(k) for k in layers], "dtype": str(dtype), "wire_dtype": str(wire_dtype)}


def cache_dir(root: str | os.PathLike, key: dict[str, Any]) -> Path:
    """`<root>/<16 hex digits of the key>`, created with the key beside its files (key.json) for a person to read."""
    text = json.dumps(key, sort_keys=True)
    d = Path(root) / hashlib.sha256(text.encode()).hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "key.json").is_file():
        _atomic_write(d / "key.json", lambda p: p.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n"))
    return d


def _path(d: Path, sample_id: int) -> Path:
    return d / f"{sample_id // 1000:06d}" / f"{sample_id}.safetensors"


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def has_all(d: str | os.PathLike, sample_ids: list[int]) -> bool:
    return all(_path(Path(d), int(i)).is_file() for i in sample_ids)


def write_batch(d: str | os.PathLike, fb: FeatureBatch) -> None:
    """Store every sample of `fb` that is not stored yet (the wire-dtype tensors as they are)."""
    d = Path(d)
    starts = fb.seq_start_S1.tolist()
    for s, sid in enumerate(fb.sample_ids):
        path = _path(d, int(sid))
        if path.is_file():
            continue
        lo, hi = starts[s], starts[s + 1]
        tensors = {"ctx": fb.ctx_feats_TF[lo:hi].contiguous(), "final": fb.final_hidden_TD[lo:hi].contiguous()}
        _atomic_write(path, lambda p, t=tensors: save_file(t, str(p)))


def read_batch(d: str | os.PathLike, batch_index: int, samples: list[TokenizedSample]) -> FeatureBatch:
    """The FeatureBatch of `samples` (in their order) from the cache; ValueError when a stored sample's length is
    not the sample's (a cache written for other data under the same key: delete the directory)."""
    d = Path(d)
    ctx, fin = [], []
    for s in samples:
        t = load_file(str(_path(d, int(s.sample_id))))
        if t["final"].shape[0] != len(s.input_ids):
            raise ValueError(f"feature cache {d}: sample {s.sample_id} holds {t['final'].shape[0]} tokens, the "
                             f"samples file {len(s.input_ids)}; the cache is stale (delete {d})")
        ctx.append(t["ctx"])
        fin.append(t["final"])
    return FeatureBatch.from_samples(batch_index, samples, torch.cat(ctx, dim=0), torch.cat(fin, dim=0),
                                     ctx_is_final=ctx[0].shape[1] == 0)


def open_feature_cache(cfg: Any, samples_digest: str, target_path: str | os.PathLike, log) -> str | None:
    """The cache directory of this run's samples, target, context layers and dtypes under `data.feature_cache`
    (None when the setting is empty: streaming only); logs how many samples it already holds. InputError (exit
    status 2) when the directory cannot be created."""
    from pipeline.errors import InputError

    root = cfg.data.feature_cache
    if not root:
        return None
    key = cache_key(samples_digest, target_path, list(cfg.draft.target_layers), cfg.target.dtype,
                    cfg.target.wire_dtype)
    try:
        d = cache_dir(root, key)
    except OSError as e:
        raise InputError(f"data.feature_cache: cannot create a cache under {root}: {e.strerror or e}") from e
    stored = sum(1 for _ in d.glob("*/*.safetensors"))
    log.info("feature cache %s: %d samples stored%s", d, stored,
             "" if stored else " (this run stores every sample it encodes; later epochs and runs read them)")
    return str(d)
