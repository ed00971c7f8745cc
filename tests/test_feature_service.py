"""The feature service on a real local Ray cluster: deterministic batch contents, bounded prefetch
(backpressure), each batch handed out once, replay mode.

Run: python -m pytest tests/test_feature_service.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import ray

from pipeline.contracts import TokenizedSample
from pipeline.order import batch_sample_ids
from pipeline.target_model import resolve_target_path
from workers.feature_service import FeatureService


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _samples(n: int) -> list[TokenizedSample]:
    rng = np.random.default_rng(0)
    return [TokenizedSample(i, rng.integers(0, 1000, size=8 + i % 5), np.ones(8 + i % 5, dtype=bool))
            for i in range(n)]


def _service(samples, max_in_flight: int, replay: int = 0):
    target = {"resolved_path": str(resolve_target_path("tiny-qwen3-moe")), "dtype": "float32",
              "wire_dtype": "bfloat16", "num_workers": 1, "cpus_per_worker": 1.0, "gpus_per_worker": 0.0,
              "device_map": "", "resources_per_worker": {}, "max_tokens_per_forward": 512}
    return FeatureService.remote(samples, target, [1, -1], 3, 7, max_in_flight, replay)


def test_prefetch_is_bounded_and_batches_are_deterministic(local_ray):
    samples = _samples(20)
    svc = _service(samples, max_in_flight=2)
    try:
        for b in range(5):
            (ref,) = ray.get(svc.get.remote(b))
            # never more than max_in_flight produced ahead of the lowest batch not yet handed out
            assert ray.get(svc.in_flight.remote()) <= 2
            fb = ray.get(ref)
            assert fb.batch_index == b
            assert list(fb.sample_ids) == batch_sample_ids(b, 20, 3, 7)
            ids = [samples[i].input_ids for i in fb.sample_ids]
            assert np.array_equal(fb.input_ids_T.numpy(), np.concatenate(ids))
            assert fb.ctx_feats_TF.shape[1] == 2 * fb.final_hidden_TD.shape[1]
        with pytest.raises(ray.exceptions.RayTaskError, match="already handed out"):
            ray.get(svc.get.remote(3))
    finally:
        ray.get(svc.shutdown.remote())
        ray.kill(svc)


def test_replay_serves_a_fixed_set(local_ray):
    svc = _service(_samples(20), max_in_flight=2, replay=2)
    try:
        first = [ray.get(ray.get(svc.get.remote(b))[0]).sample_ids for b in range(4)]
        assert first[0] == first[2] and first[1] == first[3] and first[0] != first[1]
    finally:
        ray.get(svc.shutdown.remote())
        ray.kill(svc)
