"""Placement groups of the target workers (transformers groups, vLLM engines on vLLM's "ray" executor), named so a
restart does not strand the old one.

Ray frees a placement group made by a non-detached actor only when that actor and its job are both gone. The
feature service, which makes the target workers' groups, is restarted by Ray within the same job
(workers/driver.py, max_restarts=-1) with the same actor id: without names, the groups of the service that died
would keep holding the target GPUs while the new service's groups wait for them, until the trainers time out. So
each group is named by its owner (the actor id, which a restart keeps) and the worker index, and a group of that
name found at start is removed first. Outside an actor (a driver, a test) the owner is unique to the call: a driver
that dies takes its job, and so its groups, with it.
"""

from __future__ import annotations

import uuid
from typing import Any

import ray


def group_name(kind: str, index: int) -> str:
    """`dspark-<kind>-<owner>-<index>`: the same for the same worker of a restarted actor, unique otherwise."""
    ctx = ray.get_runtime_context()
    owner = ctx.get_actor_id() or f"{ctx.get_job_id()}-{uuid.uuid4().hex[:12]}"
    return f"dspark-{kind}-{owner}-{index}"


def fresh_placement_group(bundles: list[dict[str, float]], strategy: str, name: str) -> Any:
    """A new placement group `name`; one of that name left by an earlier owner is removed first."""
    from ray.util.placement_group import placement_group, remove_placement_group

    try:
        remove_placement_group(ray.util.get_placement_group(name))
    except ValueError:  # none of that name
        pass
    return placement_group(bundles, strategy=strategy, name=name)
