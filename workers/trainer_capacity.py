"""Whether the cluster can still hold the trainer group, and the driver's bounded wait when it cannot.

After a node with trainers is lost, Ray Train restarts the group only once it can place at least
`cluster.min_trainers` of them (elastic) or all `cluster.num_trainers` (a fixed group). Where that capacity is gone
for good (a spot pool with nothing left, a node group scaled down) Ray Train waits without end, saying only its own
warnings. The driver (workers/driver.run_training) polls the live nodes' total resources (`ray.nodes()`, the GCS's
view: a node is dropped once the GCS declares it dead) and counts the trainers they could hold. While that is fewer
than the group needs it says so in one line, then once a minute; after `cluster.trainer_wait_s` it ends the run with
UNAVAILABLE_EXIT, a status a RayJob's or Job's `backoffLimit` retries, and the resubmitted job resumes from the newest
sealed checkpoint (docs/fault-tolerance.md, "A node dies"). Capacity, not what is free: trainers already placed count,
and a node shared with target workers counts whole, so the watch never ends a run that Ray could still place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

UNAVAILABLE_EXIT = 69  # EX_UNAVAILABLE: the cluster cannot hold the trainer group; resubmit to resume
LINE_EVERY_S = 60.0  # a line at least every minute while the group cannot be placed


class TrainersUnplaceable(Exception):
    """The live nodes could not hold the trainer group for `cluster.trainer_wait_s` (the launch script exits
    UNAVAILABLE_EXIT)."""


def trainer_need(use_gpu: bool, cpus_per_trainer: float, resources_per_trainer: dict[str, float]) -> dict[str, float]:
    """What one trainer rank books (Ray Train's resources_per_worker, one GPU with use_gpu), zeros left out."""
    need = {"CPU": cpus_per_trainer, **resources_per_trainer, **({"GPU": 1.0} if use_gpu else {})}
    return {k: float(v) for k, v in need.items() if v > 0}


def trainer_slots(nodes: list[dict[str, float]], need: dict[str, float]) -> int | None:
    """How many trainers these nodes' total resources hold, each on one node; None when a trainer needs nothing."""
    if not need:
        return None
    return sum(min(int(n.get(k, 0.0) / v + 1e-9) for k, v in need.items()) for n in nodes)


def _fmt(need: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in need.items()) + "}"


class CapacityWatch:
    """`poll(slots, now)` at any interval: logs when the group stops fitting, every LINE_EVERY_S while it does not,
    and when it fits again; raises TrainersUnplaceable once it has not fitted for `wait_s` (0: waits without end,
    still saying so every minute)."""

    def __init__(self, needed: int, need: dict[str, float], wait_s: float, log: logging.Logger | Callable,
                 what: str) -> None:
        self.needed, self.need, self.wait_s, self.what = needed, need, wait_s, what
        self._say = log.warning if isinstance(log, logging.Logger) else log
        self._short_since: float | None = None
        self._last_line = 0.0

    def poll(self, slots: int | None, now: float) -> None:
        if slots is None or slots >= self.needed:
            if self._short_since is not None:
                self._say(f"the cluster holds {self.needed} trainer(s) again, {now - self._short_since:.0f} s after "
                          "it could not: Ray Train restarts the group from the newest checkpoint")
                self._short_since = None
            return
        if self._short_since is None:
            self._short_since = self._last_line = now
            limit = (f"up to {self.wait_s:g} s (cluster.trainer_wait_s), then the run ends with status "
                     f"{UNAVAILABLE_EXIT} so that a retry (a RayJob's or Job's backoffLimit) resumes from the newest "
                     "checkpoint" if self.wait_s > 0 else "without end (cluster.trainer_wait_s=0)")
            self._say(f"the cluster's live nodes hold {slots} of the {self.needed} trainer(s) {self.what} needs "
                      f"({_fmt(self.need)} each): waiting for a node with that capacity {limit}")
            return
        waited = now - self._short_since
        if self.wait_s > 0 and waited >= self.wait_s:
            raise TrainersUnplaceable(
                f"the cluster's live nodes held {slots} of the {self.needed} trainer(s) {self.what} needs "
                f"({_fmt(self.need)} each) for {waited:.0f} s (cluster.trainer_wait_s={self.wait_s:g}): ended so that "
                "a resubmission of the same command resumes from the newest checkpoint")
        if now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            left = f", {self.wait_s - waited:.0f} s left" if self.wait_s > 0 else ""
            self._say(f"still waiting for a node that holds a trainer ({_fmt(self.need)}): {slots} of "
                      f"{self.needed} placeable, {waited:.0f} s so far{left}")
