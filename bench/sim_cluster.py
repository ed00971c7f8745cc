"""A simulated multi-node Ray cluster on this machine: a head and worker nodes, each its own raylet with its own
logical resources (GPUs that are only numbers to Ray, custom resources such as `target_worker`), all on loopback,
started and stopped by the caller. A node can be killed as a whole: its raylet and every process on it, SIGKILL, no
drain notice: what a preempted spot node does. Used by tests/test_node_loss.py and bench/node_loss.py; imported by its
own name (pytest puts bench/ on sys.path).

Nodes are `ray.cluster_utils.Cluster` nodes of this process (Ray's own multi-node test harness). The GCS is told to
health-check every `HEALTH_CHECK_PERIOD_MS` and to declare a node dead after `HEALTH_CHECK_FAILURES` missed checks,
so a killed node is noticed in seconds (Ray's defaults, and what a KubeRay cluster must set: docs/fault-tolerance.md).

Run (a look at one, by hand): python bench/sim_cluster.py      (starts a head and two worker nodes, prints them)
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

HEALTH_CHECK_PERIOD_MS = 1000
HEALTH_CHECK_FAILURES = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SimCluster:
    """`SimCluster(head_cpus=1)` starts the head (GCS, dashboard for the state API and job submission, its raylet)
    on 127.0.0.1; `add(name, ...)` a worker node; `kill(name)` ends a node as a whole; `stop()` everything it started.
    The head advertises no GPU and none of the custom resources, as the KubeRay head of k8s/rayjob-v4.yaml."""

    def __init__(self, head_cpus: float = 1, dashboard: bool = True) -> None:
        # loopback: Ray's local-only switch, read by the processes the nodes start and by this process's ray
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ["RAY_AUTH_MODE"] = "disabled"
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        ray_constants.ENABLE_RAY_CLUSTER = False
        self.dashboard_port = _free_port()
        self.temp_dir = f"/tmp/ray-sim-{self.dashboard_port}"
        head = {"num_cpus": head_cpus, "node_ip_address": "127.0.0.1", "gcs_server_port": _free_port(),
                "include_dashboard": dashboard, "dashboard_host": "127.0.0.1", "dashboard_port": self.dashboard_port,
                "dashboard_agent_listen_port": _free_port(), "temp_dir": self.temp_dir,
                "_system_config": {"health_check_period_ms": HEALTH_CHECK_PERIOD_MS,
                                   "health_check_timeout_ms": HEALTH_CHECK_PERIOD_MS,
                                   "health_check_failure_threshold": HEALTH_CHECK_FAILURES}}
        self._cluster = Cluster(initialize_head=True, head_node_args=head, shutdown_at_exit=True)
        self.address = self._cluster.address
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.nodes: dict[str, Any] = {}

    def add(self, name: str, num_cpus: float = 1, num_gpus: float = 0, resources: dict[str, float] | None = None,
            ) -> str:
        """Start worker node `name` with these logical resources; returns its Ray node id."""
        assert name not in self.nodes, f"node {name} is already up"
        node = self._cluster.add_node(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {},
                                      node_ip_address="127.0.0.1", temp_dir=self.temp_dir)
        self.nodes[name] = node
        return node.node_id

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def kill(self, name: str) -> None:
        """The node's raylet and every process on it SIGKILLed at once (no graceful shutdown, no drain)."""
        self._cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def kill_head(self) -> None:
        """The head as a whole: its GCS, raylet and dashboard SIGKILLed; the worker nodes are left without it (their
        raylets give up on the GCS after a minute, or at stop())."""
        self._cluster.remove_node(self._cluster.head_node, allow_graceful=False)

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self._cluster.shutdown()
        # Cluster wrote this head's address to /tmp/ray/ray_current_cluster (Ray's address "auto" looks there first):
        # gone with the head, it would send other local clusters' Ray Train cleaner to a dead GCS
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip() == self.address:
            current.unlink(missing_ok=True)


def launch_on(sim: SimCluster, run_dir: Path, log: Path, args: list[str]):
    """`python launch/train_v4_draft.py --run-dir RUN_DIR ARGS` against the simulated cluster (RAY_ADDRESS), as a user
    runs it on a head node, in the background; its output goes to `log`. PYTHONPATH names this checkout: an
    editable install of another checkout would otherwise be what the driver and its workers import."""
    import subprocess
    import sys

    from launch_helpers import LAUNCH, REPO, quiet_env

    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, str(LAUNCH), "--run-dir", str(run_dir), *args], cwd=REPO,
                                env=quiet_env(RAY_ADDRESS=sim.address, PYTHONPATH=str(REPO)), stdout=out,
                                stderr=subprocess.STDOUT)


def manifest_nodes(manifest: dict[str, Any], replicas: dict[str, int] | None = None) -> list[tuple[str, dict]]:
    """(name, add() keyword arguments) for each pod of a KubeRay RayJob's worker groups, as Ray sees the pod: its
    container CPU limit as CPUs, its `nvidia.com/gpu` limit as GPUs, its rayStartParams `resources`; `replicas`
    overrides a group's pod count (another preset on pods of the same shape)."""
    import json

    nodes = []
    for group in manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        containers = group["template"]["spec"]["containers"]
        cpus = sum(float(c["resources"]["limits"]["cpu"]) for c in containers)
        gpus = sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in containers)
        raw = group["rayStartParams"].get("resources")
        resources = json.loads(json.loads(raw)) if raw else {}  # KubeRay's format: a JSON object quoted as a string
        for i in range((replicas or {}).get(group["groupName"], group["replicas"])):
            nodes.append((f"{group['groupName']}-{i}", {"num_cpus": cpus, "num_gpus": gpus, "resources": resources}))
    return nodes


if __name__ == "__main__":
    import ray

    sim = SimCluster()
    try:
        sim.add("a", num_cpus=2, num_gpus=8, resources={"target_worker": 8})
        sim.add("b", num_cpus=2, resources={"trainer": 2})
        ray.init(address=sim.address)
        for n in ray.nodes():
            print(n["NodeID"][:8], n["NodeManagerAddress"], n["Resources"])
    finally:
        sim.stop()
