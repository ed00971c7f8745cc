"""The feature cache (workers/frozen_target/feature_cache.py, `data.feature_cache`): what the target worker ships is
stored per sample and read back exactly; a second epoch trains on the stored features; another run of the same
samples, target and context layers never runs the target; anything else gets its own directory; a stale entry is
one clear error. The Ray path (the feature service reading through a task) is checked in test_feature_service.py.

Run: python -m pytest tests/test_feature_cache.py -q
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from launch_helpers import REPO, TINY_MOE

from pipeline.contracts import TokenizedSample
from pipeline.metrics import read_jsonl_metrics
from workers.frozen_target import feature_cache as fc


def _samples(n: int, seed: int = 0) -> list[TokenizedSample]:
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(g.integers(5, 30))
        out.append(TokenizedSample(i, g.integers(0, 49152, L).astype(np.int64), g.random(L) < 0.7))
    return out


@pytest.fixture(scope="module")
def tiny_target():
    from workers.frozen_target.model import resolve_target_path

    return resolve_target_path("tiny-qwen3-moe")


@pytest.mark.parametrize("layers", [[1, 2], [-1]])
def test_a_batch_read_back_is_the_batch_the_worker_shipped(tmp_path, tiny_target, layers):
    from workers.frozen_target.worker import TargetWorker

    worker = TargetWorker(tiny_target, layers, "float32", "bfloat16", max_tokens_per_forward=64)
    samples = _samples(6)
    d = fc.cache_dir(tmp_path, fc.cache_key("digest", tiny_target, layers, "float32", "bfloat16"))
    assert not fc.has_all(d, [s.sample_id for s in samples])
    shipped = worker.encode(3, samples[:4], str(d))
    assert fc.has_all(d, [0, 1, 2, 3]) and not fc.has_all(d, [0, 4])
    # another batch order and grouping: read back sample by sample, in the order asked for
    back = fc.read_batch(d, 7, [samples[2], samples[0]])
    assert back.batch_index == 7 and back.sample_ids == (2, 0) and back.ctx_is_final == (layers == [-1])
    s = shipped.seq_start_S1.tolist()
    for field in ("ctx_feats_TF", "final_hidden_TD", "input_ids_T", "loss_mask_T"):
        want = torch.cat([getattr(shipped, field)[s[2]:s[3]], getattr(shipped, field)[s[0]:s[1]]])
        got = getattr(back, field)
        assert got.dtype == want.dtype and torch.equal(got, want), field
    # a stored entry whose sample changed under the same key is refused by name
    longer = TokenizedSample(0, np.zeros(40, np.int64), np.ones(40, bool))
    with pytest.raises(ValueError, match="sample 0 holds .* tokens, the samples file 40; the cache is stale"):
        fc.read_batch(d, 0, [longer])


def test_the_key_separates_what_the_features_depend_on(tmp_path, tiny_target):
    key = fc.cache_key("digest", tiny_target, [1, 2], "float32", "bfloat16")
    same = fc.cache_dir(tmp_path, key)
    assert fc.cache_dir(tmp_path, dict(key)) == same and (same / "key.json").is_file()
    for other in (fc.cache_key("other", tiny_target, [1, 2], "float32", "bfloat16"),
                  fc.cache_key("digest", tiny_target, [2], "float32", "bfloat16"),
                  fc.cache_key("digest", tiny_target, [1, 2], "bfloat16", "bfloat16"),
                  fc.cache_key("digest", tiny_target, [1, 2], "float32", "float32")):
        assert fc.cache_dir(tmp_path, other) != same


def _run(tmp_path, name: str, cache: str, steps: int = 8):
    from pipeline.config import load_config
    from workers.trainer.single_process import train_single_process

    run_dir = tmp_path / name
    cfg = load_config(REPO / "launch" / "configs" / "tiny.yaml",
                      [*TINY_MOE, f"train.max_steps={steps}", "data.num_samples=16", "train.tensorboard=false",
                       f"checkpoint.run_dir={run_dir}", "checkpoint.every_steps=100", f"data.feature_cache={cache}"])
    train_single_process(cfg, logging.getLogger("test.feature_cache"), device="cpu")
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def test_cached_epochs_train_the_streamed_loss_and_a_second_run_never_runs_the_target(tmp_path, monkeypatch):
    """16 samples in batches of 4: steps 1-4 are epoch 1, 5-8 epoch 2. With the cache on, epoch 1 is the streamed
    run's exactly (storing changes nothing) and epoch 2 trains on the stored features: the streamed epoch 2
    encodes the same samples in other batches, which may move a float's last bit before the bf16 wire rounding, so
    the losses agree to 1e-5. A second run on the same cache reads every batch (the target worker's encode is
    made to fail) and trains exactly the cached run's losses."""
    from workers.frozen_target.worker import TargetWorker

    streamed = _run(tmp_path, "streamed", "")
    cached = _run(tmp_path, "cached", str(tmp_path / "cache"))
    assert sorted(streamed) == sorted(cached) == list(range(1, 9))
    for s in range(1, 5):
        assert cached[s] == streamed[s], s
    for s in range(5, 9):
        assert cached[s] == pytest.approx(streamed[s], rel=1e-5), s
    (d,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(list(d.glob("*/*.safetensors"))) == 16

    def no_target(self, *a, **k):
        raise AssertionError("the target ran although every sample is cached")

    monkeypatch.setattr(TargetWorker, "encode", no_target)
    again = _run(tmp_path, "again", str(tmp_path / "cache"))
    assert again == cached and all(math.isfinite(v) for v in again.values())


def test_a_cache_root_that_cannot_be_created_is_one_input_error(tmp_path):
    from pipeline.config import load_config
    from pipeline.errors import InputError

    (tmp_path / "file").write_text("not a directory")
    cfg = load_config(REPO / "launch" / "configs" / "tiny.yaml", [f"data.feature_cache={tmp_path / 'file'}"])
    with pytest.raises(InputError, match="data.feature_cache: cannot create a cache under"):
        fc.open_feature_cache(replace(cfg), "digest", tmp_path, logging.getLogger("t"))
