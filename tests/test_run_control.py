"""The trainers' per-step poll (workers/run_control.StopPoller) on a real local Ray cluster: a drain of this rank's
node asks for one checkpoint per notice, read from the GCS by the rank itself; and the driver turns Ray Train's own
preemption watcher off (its actor is what Ray logged at error level on every healthy run) and starts Ray
Train's autoscaling coordinator before the trainer group asks it with a 5 s timeout.

Run: python -m pytest tests/test_run_control.py -q
"""

from __future__ import annotations

import os
import threading

import pytest

from workers import run_control


def test_a_drain_of_this_node_is_one_checkpoint_per_notice(local_ray, monkeypatch):
    assert run_control.draining_nodes() == {}  # the real GCS call, on a cluster nothing drains
    drains: dict[str, int] = {}
    monkeypatch.setattr(run_control, "draining_nodes", lambda: dict(drains))
    monkeypatch.setattr(run_control, "DRAIN_POLL_S", 0.0)
    poller = run_control.StopPoller(run_control.RunControl.remote(), threading.Event())
    node = local_ray.get_runtime_context().get_node_id()
    assert not poller().checkpoint
    drains["another-node"] = 0
    assert not poller().checkpoint  # a drain elsewhere is not this rank's
    drains[node] = 0
    first, second = poller(), poller()
    assert first.checkpoint and not second.checkpoint and not first.stop
    del drains[node]
    assert not poller().checkpoint
    drains[node] = 123
    assert poller().checkpoint  # a new notice after the last one ended


def test_drains_are_polled_at_most_every_few_seconds(local_ray, monkeypatch):
    poller = run_control.StopPoller(run_control.RunControl.remote(), threading.Event())
    calls = []
    monkeypatch.setattr(run_control, "draining_nodes", lambda: calls.append(1) or {})
    for _ in range(5):
        poller()
    assert len(calls) == 1


def test_ray_train_s_start_is_settled_first(local_ray, monkeypatch):
    from ray.train.v2._internal.constants import ENV_VARS_TO_PROPAGATE

    assert run_control.WATCHER_ENV in ENV_VARS_TO_PROPAGATE  # Ray Train hands it from the driver to its controller
    monkeypatch.delenv(run_control.WATCHER_ENV, raising=False)
    run_control.prepare_ray_train()
    assert os.environ[run_control.WATCHER_ENV] == "0"
    # the coordinator Ray Train's controller asks with a 5 s timeout is up and answering
    coordinator = local_ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    local_ray.get(coordinator.__ray_ready__.remote(), timeout=5)
    monkeypatch.setenv(run_control.WATCHER_ENV, "1")
    run_control.prepare_ray_train()
    assert os.environ[run_control.WATCHER_ENV] == "1"  # the user's choice stands


@pytest.fixture(autouse=True)
def _quiet_logs(caplog):
    caplog.set_level("ERROR")
