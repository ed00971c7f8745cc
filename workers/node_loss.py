"""Whole-node loss as the cluster's control plane sees it: which nodes the GCS has declared dead, and which node an
actor runs on now.

A node that disappears (a preempted spot VM, a pod evicted without notice) sends no signal: its raylet stops
answering the GCS's health checks, and after `health_check_failure_threshold` missed checks of
`health_check_period_ms` each the GCS marks it dead (docs/fault-tolerance.md, "A node dies": Ray's defaults and what a
KubeRay cluster sets). From then on `ray.nodes()` reports it `Alive: False`, and an actor that lived there is
RESTARTING (restartable actors: waiting for a node with its resources, which may never come) or DEAD.

The node of an actor comes from the GCS actor table (`ray._private.state.actors`): the source the state API reads
too, but answered by the GCS itself, so it works on a cluster without a dashboard. Private to Ray; kept to this file.
"""

from __future__ import annotations

import socket
from typing import Any

import ray

HEAD_LOST_S = 15.0  # the GCS unreachable this long: the driver gives the run up (workers/driver.fit_watching_capacity)


def dead_nodes() -> set[str]:
    """Node ids (hex) the GCS has declared dead in this cluster's life."""
    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}


def actor_node(handle: Any) -> str | None:
    """The node id (hex) an actor is alive on now; None while it is pending, restarting or dead."""
    from ray._private.state import actors

    info = actors(actor_id=handle._actor_id.hex())
    if not info or info.get("State") != "ALIVE":
        return None
    return info["Address"]["NodeID"] or None


def short(node_id: str) -> str:
    """A node id as Ray's own logs abbreviate it."""
    return node_id[:8]


def head_answers(address: str, timeout: float = 2.0) -> bool:
    """Whether the GCS at `address` (host:port) accepts a connection now. Raises ValueError for a malformed one."""
    host, port = address.strip().rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(timeout)
        try:
            return s.connect_ex((host, int(port))) == 0
        except OSError:  # an unknown host, a timeout
            return False
