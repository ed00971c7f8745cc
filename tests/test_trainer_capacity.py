"""The driver's watch over whether the live nodes still hold the trainer group (workers/trainer_capacity.py): what
counts as a slot, when it speaks, when it gives up. The run that loses the capacity for good, through the launch
script on a simulated cluster, is tests/test_node_loss.py's (slow)."""

from __future__ import annotations

import pytest

from workers.trainer_capacity import UNAVAILABLE_EXIT, CapacityWatch, TrainersUnplaceable, trainer_need, trainer_slots


def test_slots_count_whole_trainers_per_node_from_total_resources():
    need = trainer_need(use_gpu=True, cpus_per_trainer=4, resources_per_trainer={"trainer": 1})
    assert need == {"CPU": 4.0, "trainer": 1.0, "GPU": 1.0}
    nodes = [{"CPU": 32, "GPU": 8, "trainer": 8},  # 8 trainers
             {"CPU": 7, "GPU": 8, "trainer": 8},  # 1: the CPUs bind
             {"CPU": 64, "GPU": 8}]  # a target node: no trainer slot
    assert trainer_slots(nodes, need) == 9
    assert trainer_slots([], need) == 0
    assert trainer_need(False, 0, {}) == {} and trainer_slots(nodes, {}) is None  # needs nothing: never short


def test_the_watch_says_it_waits_every_minute_then_gives_up():
    said: list[str] = []
    watch = CapacityWatch(2, {"CPU": 1.0, "trainer": 1.0}, wait_s=150, log=said.append, what="the trainer group")
    watch.poll(2, 0.0)
    watch.poll(None, 1.0)
    assert said == []  # fits: silent
    watch.poll(1, 10.0)
    assert len(said) == 1
    assert "hold 1 of the 2 trainer(s) the trainer group needs ({CPU: 1, trainer: 1} each)" in said[0]
    assert f"up to 150 s (cluster.trainer_wait_s), then the run ends with status {UNAVAILABLE_EXIT}" in said[0]
    for t in range(15, 70, 5):
        watch.poll(1, float(t))
    assert len(said) == 1  # not every poll
    watch.poll(1, 70.0)
    assert len(said) == 2 and said[1].startswith("still waiting") and "60 s so far, 90 s left" in said[1]
    with pytest.raises(TrainersUnplaceable, match=r"held 1 of the 2 trainer\(s\) .* for 150 s .*resumes from the "
                                                  "newest checkpoint"):
        watch.poll(1, 160.0)


def test_capacity_back_resets_the_wait_and_zero_waits_without_end():
    said: list[str] = []
    watch = CapacityWatch(2, {"CPU": 1.0}, wait_s=100, log=said.append, what="the trainer group")
    watch.poll(0, 0.0)
    watch.poll(2, 90.0)
    assert "holds 2 trainer(s) again, 90 s after" in said[-1]
    watch.poll(1, 95.0)
    watch.poll(1, 190.0)  # 95 s into the second shortage: still waiting
    with pytest.raises(TrainersUnplaceable):
        watch.poll(1, 196.0)
    forever = CapacityWatch(1, {"CPU": 1.0}, wait_s=0, log=said.append, what="x")
    forever.poll(0, 0.0)
    assert "without end (cluster.trainer_wait_s=0)" in said[-1]
    for t in range(1, 10_000, 7):
        forever.poll(0, float(t))
    assert said[-1].startswith("still waiting") and "left" not in said[-1]


class _Context:
    gcs_address = "127.0.0.1:1"  # nothing listens: the head watch must not mistake a fit that ends for a lost head


def test_fit_runs_off_the_main_thread_and_its_error_reaches_the_caller(monkeypatch):
    """Ray Train installs its own SIGINT handler (abort, exit 1, no checkpoint) when fit runs on the main thread;
    off it, Ctrl-C stays the driver's checkpoint-then-stop (exit 75). Measured before this: SIGINT at step 4 of a
    default run ended it with status 1 and Ray Train's 'Gracefully aborting the training run'."""
    import logging
    import threading

    import ray

    from pipeline.config import RunConfig
    from workers import driver

    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context())
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}}])
    monkeypatch.setattr("workers.node_loss.head_answers", lambda _: True)
    seen = []

    class Trainer:
        def __init__(self, error=None):
            self.error = error

        def fit(self):
            seen.append(threading.current_thread() is threading.main_thread())
            if self.error:
                raise self.error

    driver.fit_watching_capacity(Trainer(), RunConfig(), logging.getLogger("t"), poll_s=0.01)
    with pytest.raises(KeyError, match="boom"):
        driver.fit_watching_capacity(Trainer(KeyError("boom")), RunConfig(), logging.getLogger("t"), poll_s=0.01)
    assert seen == [False, False]
