"""Stop requests for a running job: a preemption notice becomes a checkpoint at the next step boundary.

A SIGTERM (Kubernetes eviction of the driver's pod, `ray job stop`, a spot-instance notice turned into a signal,
Ctrl-C's cousin `kill`) reaches the driver; the trainers run elsewhere. The driver's handler records the request
in `RunControl`, a zero-CPU actor of the job; every trainer rank asks it once per step (a ~1 ms call) and the
ranks' votes are summed with the metrics, so all of them checkpoint after the same step and return
(workers/trainer/loop.fit). The driver then raises workers/preemption.StoppedEarly and exits with its status.

A trainer process that gets SIGTERM itself (its node is drained) records the request the same way, through its
own handler, so the group still stops together; a rank that is killed outright is a trainer failure instead
(Ray Train restarts the group from the last checkpoint).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray

from workers.lease import Fence
from workers.preemption import Notice

log = logging.getLogger(__name__)

DRAIN_POLL_S = 5.0  # how often a rank asks for drains: Ray Train's own watcher polls this often

WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def prepare_ray_train() -> None:
    """Settle, before a trainer group starts, the two things Ray Train 2.60 does at that start which print a
    failure on a healthy run:

    - its PreemptionWatcher, an actor it creates with max_restarts=-1 and the worker handles as constructor
      arguments, which Ray reports at error level ("has constructor arguments in the object store"): turned off
      (Ray Train passes the variable from the driver's environment to its controller; a value the user set is
      kept). StopPoller does the same drain poll itself, for its own node.
    - its autoscaling coordinator, a detached actor the controller asks with a 5 s timeout, logging a traceback
      when the actor is still starting on a busy machine: started here, and waited for.
    """
    os.environ.setdefault(WATCHER_ENV, "0")
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
    except ImportError:  # another Ray: nothing to warm
        return
    ray.get(get_or_create_autoscaling_coordinator().__ray_ready__.remote())


def draining_nodes() -> dict[str, int]:
    """The cluster's nodes being drained, {node id hex: deadline ms (0: none)}, as the GCS reports them: the source
    Ray Train's own watcher polls."""
    return ray._private.state.state.get_draining_nodes() or {}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RunControl:
    def __init__(self) -> None:
        self._reason: str | None = None
        self._fatal: str | None = None

    def request_stop(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason

    def stop_reason(self) -> str | None:
        return self._reason

    def record_fatal(self, message: str) -> None:
        """A trainer failed in a way a restart would repeat (workers/trainer/ray_trainer.FATAL_ERRORS)."""
        if self._fatal is None:
            self._fatal = message

    def fatal_error(self) -> str | None:
        return self._fatal


class StopPoller:
    """`poll` for workers/trainer/loop.fit on a Ray Train rank, once per step, on every rank:
    - stop: the driver (or a trainer's own SIGTERM handler) asked RunControl to stop;
    - checkpoint: this rank's node is being drained (a spot reclaim or an autoscaler drain), as Ray's GCS reports
      it (`draining_nodes`, polled every DRAIN_POLL_S). The group checkpoints at once (the ranks' votes are
      summed) and trains on; when the node goes, Ray Train restarts the group and it resumes from that
      checkpoint, losing nothing. Reported once per notice.
    - gone: the driver is gone: the run dir's lease was taken over, released or not renewed (workers/lease.py), or
      RunControl, which dies with the driver, is dead. Every rank stops at once and commits nothing."""

    def __init__(self, control: Any, local_stop: threading.Event, timeout_s: float = 10.0,
                 fence: Fence | None = None) -> None:
        """`local_stop`: set by this rank's own SIGTERM handler (workers/preemption.stop_on_signal), which also
        tells RunControl, so the other ranks stop after the same step. `fence`: the run dir's lease as the driver
        took it (workers/lease.py), read every step."""
        self.control, self.local_stop, self.timeout_s, self.fence = control, local_stop, timeout_s, fence
        self._node = ray.get_runtime_context().get_node_id()
        self._drain_seen = False
        self._next_drain_poll = 0.0

    def _drained(self) -> bool:
        if time.monotonic() < self._next_drain_poll:
            return self._drain_seen
        self._next_drain_poll = time.monotonic() + DRAIN_POLL_S
        try:
            return self._node in draining_nodes()
        except Exception as e:  # a GCS hiccup is no drain notice: the next poll asks again
            log.debug("could not read the draining nodes: %s", e)
            return self._drain_seen

    def __call__(self) -> Notice:
        drained = self._drained()
        checkpoint = drained and not self._drain_seen
        self._drain_seen = drained
        if checkpoint:
            log.warning("a node of this trainer group is being drained: checkpointing now")
        gone = (self.fence.check() if self.fence is not None else None) or ""
        if self.local_stop.is_set():
            return Notice(stop=True, checkpoint=checkpoint, gone=gone)
        try:
            stop = ray.get(self.control.stop_reason.remote(), timeout=self.timeout_s) is not None
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            log.warning("run control did not answer within %.0f s; training on", self.timeout_s)
            stop = False
        except ray.exceptions.RayActorError:
            # RunControl restarts after its own crashes (max_restarts=-1): dead for good means its owner, the
            # driver, died (Ray kills a driver's actors with it, but not at once: seen ~2 s of training on)
            stop, gone = False, gone or "the driver is gone (its run control actor died with it)"
        return Notice(stop=stop, checkpoint=checkpoint, gone=gone)
