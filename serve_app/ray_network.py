"""Ray's own ports and who can reach them: a single-machine Ray on loopback, a cluster checked at startup.

With Ray's token authentication off, anyone who reaches a Ray port (the dashboard agent's job API, GCS, a
raylet, a worker's gRPC port) can run code as the server's user, and Ray's metrics exporters show the
server's metrics without a key. So:
- a Ray that `tensorfold serve` (or `tensorfold bench serve`) starts itself keeps every port on 127.0.0.1:
  `local_ray_env()` gives Ray's single-machine mode (node address 127.0.0.1, which its gRPC servers, the
  dashboard agent and the metrics exporters then bind); `serve run` gets it from the same variable on its
  command line (docs/operations.md);
- the app builder, on any cluster, refuses to start while Ray's token authentication is off and Ray listens
  beyond loopback, unless `allow_unauthenticated_ray_network` says the operator accepts that risk.
"""

import ipaddress
import logging
import os
import sys
from dataclasses import dataclass

from serve_app.listen_checks import is_loopback

log = logging.getLogger("tensorfold.app")
# Ray reads this when it is imported: 0 makes Ray single-machine, its node address 127.0.0.1 (Ray's own
# default on macOS and Windows).
LOCAL_RAY_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SAFE_SERVE_RUN = f"{LOCAL_RAY_VARIABLE}=0 serve run configs/glm.yaml"
ALLOW_SETTING = "allow_unauthenticated_ray_network"


@dataclass(frozen=True)
class RayExposure:
    """What decides whether Ray's ports let strangers in."""

    token_auth: bool  # Ray's token authentication is on (RAY_AUTH_MODE=token)
    hosts: tuple[str, ...]  # the addresses Ray's ports are bound to: each node's, the GCS's, the dashboard's


def local_ray_env() -> dict[str, str]:
    """What a process that starts a single-machine Ray sets before importing Ray (an explicit value wins)."""
    return {LOCAL_RAY_VARIABLE: os.environ.get(LOCAL_RAY_VARIABLE, "0")}


def keep_local_ray_on_loopback() -> None:
    """Before this process imports Ray (which reads the variable then): a Ray it starts binds 127.0.0.1, and
    a driver given 127.0.0.1 as the address dials it there, not at the machine's address (Ray's default).
    A driver joining a Ray on the machine's address is unaffected: it finds its node by the local raylet."""
    os.environ.update(local_ray_env())
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("Ray was imported before it could be kept on loopback: import it after init_ray")


def is_loopback_host(host: str) -> bool:
    """Loopback, including IPv4-mapped IPv6 (`::ffff:127.0.0.1`, as dual-stack sockets report it)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return is_loopback(host)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def exposed_hosts(exposure: RayExposure) -> list[str]:
    """The addresses beyond loopback that Ray listens on, each once, in order."""
    return list(dict.fromkeys(host for host in exposure.hosts if not is_loopback_host(host)))


def refusal(exposure: RayExposure, allowed: bool) -> str | None:
    """The one line that stops startup, or None: token auth off and a Ray port reachable beyond loopback."""
    exposed = exposed_hosts(exposure)
    if exposure.token_auth or not exposed or allowed:
        return None
    return (
        f"Ray's token authentication is off (RAY_AUTH_MODE=disabled) and Ray listens on {', '.join(exposed)}: "
        "anyone who reaches those ports can run code as this server's user. On one machine start Ray on "
        f"loopback (tensorfold serve does; for serve run: {SAFE_SERVE_RUN}); on a cluster turn on Ray's token "
        f"authentication (RAY_AUTH_MODE=token); or accept the risk with {ALLOW_SETTING} "
        "(--allow-unauthenticated-ray-network)."
    )


def warning(exposure: RayExposure, allowed: bool) -> str | None:
    """The warning logged once when the operator accepted the risk that `refusal` names."""
    if refusal(exposure, allowed=False) is None or not allowed:
        return None
    exposed = ", ".join(exposed_hosts(exposure))
    return f"WARNING: {ALLOW_SETTING} is set: Ray's ports on {exposed} run code for anyone who reaches them"


def _host_of(address: str) -> str:
    """`host:port`, `[v6]:port` or a bare host, to the host."""
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def read_exposure() -> RayExposure:
    """Ask the connected Ray: its auth mode, every live node's address, the GCS's and the dashboard's."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled
    from ray.experimental.internal_kv import _internal_kv_get

    hosts = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")]
    hosts.append(_host_of(ray.get_runtime_context().gcs_address))
    dashboard = _internal_kv_get("dashboard", namespace=b"dashboard")  # "host:port", where one runs
    if dashboard:
        hosts.append(_host_of(dashboard.decode()))
    return RayExposure(token_auth=is_token_auth_enabled(), hosts=tuple(hosts))


class RayNetworkError(RuntimeError):
    """Ray's ports are open to the network without authentication (the message says what to do)."""


def started_here() -> bool:
    """This process started the Ray it runs on (`serve run` or `ray.init()` without an address): a
    single-machine Ray, not a cluster it joined."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return bool(node is not None and node.all_processes)  # a joining driver's node starts no process


def check_ray_network(allowed: bool) -> None:
    """Startup's check, in the app builder: refuse to join an unauthenticated Ray cluster reachable beyond
    loopback. A single-machine Ray this command started itself (plain `serve run`) has bound its ports
    already: that is a WARNING naming the safe command, so the documented start keeps working."""
    import ray

    if not ray.is_initialized():  # built outside Ray: nothing listens yet
        return
    exposure = read_exposure()
    line = refusal(exposure, allowed)
    if line is not None and started_here():
        log.warning("%s This command started that Ray itself, so it starts anyway.", line)
        return
    if line is not None:
        raise RayNetworkError(line)
    risk = warning(exposure, allowed)
    if risk is not None:
        log.warning(risk)
