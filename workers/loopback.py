"""A local run binds every socket to loopback: Ray's own (GCS, raylet, object manager, agents), the TCPStore that
forms a torch.distributed group, and gloo's (or NCCL's) connections.

Ray binds its servers to the node's IP address when it is a loopback one, and to every interface otherwise (GCS,
raylet and workers on `*:port`, the runtime-env agent on the LAN address: measured with Ray 2.60). Its node IP is
only loopback in Ray's local-only mode: `ray.init(_node_ip_address="127.0.0.1")` and `ray start
--node-ip-address=127.0.0.1` both turn 127.0.0.1 into the LAN address (services.resolve_ip_for_localhost) unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the switch that keeps a laptop's Ray off the network. `local_ray_on_loopback`
sets it for a cluster the driver starts itself (workers/driver.connect_ray). torch.distributed's TCPStore
server listens on every interface whatever MASTER_ADDR says (`TCPStore("127.0.0.1", ..., is_master=True)` still
shows as `*:port`), and it has no authentication: anyone who reaches the port can write keys into the rendezvous.
`serve_store` binds the socket itself and hands it to the store (`master_listen_fd`), so the store listens on the
one address its peers are told. gloo binds its pairs to the address of the interface named by GLOO_SOCKET_IFNAME
(else the one the host name resolves to, often the LAN address), NCCL's bootstrap likewise by NCCL_SOCKET_IFNAME:
`use_loopback_interface` names the loopback interface for both, unless the user set them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"


# Ray's local-only switch; read into ray._private.ray_constants.ENABLE_RAY_CLUSTER when ray is imported
RAY_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_on_loopback() -> None:
    """Before `ray.init(address="local")`: the cluster about to start takes 127.0.0.1 as its node IP, so every Ray
    process binds to loopback. The environment carries it to the processes Ray starts (GCS, raylet, agents,
    workers); this process read it when it imported ray, so its copy is set as well."""
    os.environ[RAY_LOCAL_ONLY_ENV] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def is_local_cluster(nodes: list[dict[str, Any]]) -> bool:
    """Whether every live node of a Ray cluster (ray.nodes()) sits on a loopback address: a cluster of this host
    alone, whose processes need no other interface."""
    alive = [n for n in nodes if n.get("Alive")]
    return bool(alive) and all(is_loopback(str(n.get("NodeManagerAddress", ""))) for n in alive)


def loopback_interface() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def use_loopback_interface() -> None:
    """gloo and NCCL open their sockets on the loopback interface (a user's own choice stays)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback_interface())


def serve_store(host: str, world_size: int | None, timeout: timedelta) -> Any:
    """A TCPStore server (rank 0's) listening on `host` only, on a free port (`.port`). It keeps the socket: the
    process must hold the store as long as the group lives."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        # the libuv store (torch's default) takes a listening socket; the legacy one does not
        store = dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout, wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now; Python must not close it when `sock` is collected
    return store


def join_store(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """A client of the store `serve_store` started (every rank but 0)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, False, timeout)
