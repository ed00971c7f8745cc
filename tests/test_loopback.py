"""A local run listens on loopback only (workers/loopback.py, workers/trainer/process_group.py), and the harness runs
the Ray CLI of its own interpreter (bench/launch_helpers.RAY_CLI).

The default tests are in-process, a few seconds: the store binds only the address asked for and serves its clients;
what counts as a local cluster. The slow one starts a real local run through the launch script, in the environment
a user has (no RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which would put Ray on loopback by itself), and lists every
socket its process tree listens on while it runs.

Run: python -m pytest tests/test_loopback.py -q     (-m slow adds the real run: 1-4 minutes on 2 cores)
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from launch_helpers import LAUNCH, RAY_CLI, REPO, TINY_MOE, quiet_env

from workers.loopback import LOOPBACK, is_local_cluster, join_store, serve_store

psutil = pytest.importorskip("psutil")


def _listening(pids: list[int]) -> dict[tuple[str, int], int]:
    """(address, port) -> pid of every TCP socket listening in these processes (UDP: Ray opens none)."""
    out = {}
    for pid in pids:
        try:
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def test_store_listens_on_its_address_only_and_serves_clients():
    store = serve_store(LOOPBACK, 2, timedelta(seconds=30))
    assert list(_listening([os.getpid()]).keys()).count((LOOPBACK, store.port)) == 1
    assert not [a for a in _listening([os.getpid()]) if a[1] == store.port and a[0] != LOOPBACK]
    client = join_store(LOOPBACK, store.port, 2, timedelta(seconds=30))
    client.set("k", "from rank 1")
    assert store.get("k") == b"from rank 1"


def test_a_local_ray_takes_a_loopback_node_ip(monkeypatch):
    """ray.init(_node_ip_address="127.0.0.1") would be turned into the LAN address; the local-only switch is not."""
    from ray._private import ray_constants, services

    from workers.loopback import RAY_LOCAL_ONLY_ENV, local_ray_on_loopback

    monkeypatch.delenv(RAY_LOCAL_ONLY_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    local_ray_on_loopback()
    assert os.environ[RAY_LOCAL_ONLY_ENV] == "0" and services.get_node_ip_address() == LOOPBACK


def test_a_cluster_is_local_when_every_live_node_is_on_loopback():
    node = {"Alive": True, "NodeManagerAddress": "127.0.0.1"}
    assert is_local_cluster([node, {**node, "NodeManagerAddress": "::1"}])
    assert is_local_cluster([node, {"Alive": False, "NodeManagerAddress": "10.0.0.7"}])
    assert not is_local_cluster([node, {"Alive": True, "NodeManagerAddress": "10.0.0.7"}])
    assert not is_local_cluster([])


def test_ray_cli_is_this_interpreters():
    """`venv/bin/python bench/faults.py` from a venv that is not activated: no `ray` (nor `python`) on PATH."""
    import ray

    res = subprocess.run([*RAY_CLI, "--version"], env={**os.environ, "PATH": "/nonexistent"}, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and ray.__version__ in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_local_run_listens_on_loopback_only(tmp_path):
    env = quiet_env(PYTHONPATH=str(REPO))
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")  # Ray's own loopback switch: the run must not need it
    proc = subprocess.Popen([sys.executable, str(LAUNCH), "--run-dir", str(tmp_path / "run"), "--max-steps", "4",
                             *TINY_MOE, "cluster.num_trainers=2"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "stderr", "w"), start_new_session=True)
    seen: dict[tuple[str, int], str] = {}
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        names = {p.pid: p for p in procs}
        for addr, pid in _listening(list(names)).items():
            try:
                seen.setdefault(addr, os.path.basename(names[pid].cmdline()[0]))  # gcs_server, ray::IDLE, ...
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.3)
    assert proc.wait() == 0, (tmp_path / "stderr").read_text()[-3000:]
    names = set(seen.values())
    # the run was seen: Ray's servers and both trainers (the trainers' store and gloo pairs)
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), seen
    assert sum("RayTrainWorker" in n for n in names) >= 1, seen
    assert {a: n for a, n in seen.items() if not _is_loopback(a[0])} == {}
