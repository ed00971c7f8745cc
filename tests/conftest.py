"""Fixtures shared by the test modules.

Run: python -m pytest -m "not slow" -q -n 2 --dist loadfile   (the whole default suite, as the README runs it; this
     file only defines fixtures: under xdist each worker process gets its own)
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest):
    """A private local Ray cluster for the tests of one module, stopped after the last of them; yields the ray module.

    address="local" always starts a fresh cluster, never joining one that another process left running on this
    machine. The workers import this checkout (workers.driver.worker_runtime_env, as a driver started by hand
    does). Two logical CPUs unless the module sets RAY_CPUS (a target group needs one per member).
    """
    import ray

    from workers.driver import worker_runtime_env

    ray.init(address="local", num_cpus=getattr(request.module, "RAY_CPUS", 2), include_dashboard=False,
             runtime_env=worker_runtime_env())
    yield ray
    ray.shutdown()
