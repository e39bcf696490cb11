"""Starting Ray, Serve and the graph from a process that owns the cluster: `tensorfold serve` and
`tensorfold bench serve` share this, so the benchmark measures what the command serves.

HTTP reaches the Ingress deployment one of two ways (`HttpEntry`):
- "ingress" (the default): Serve's direct ingress. The Ingress replica, placed on this node, runs the HTTP
  server on host:port itself. Serve still starts its own proxy in this mode; it listens on a free port.
- "proxy": Serve's HTTP proxy listens on host:port and hands each request to the Ingress replica, as under
  `serve run configs/glm.yaml` (whose controller settings come from the YAML, not from here).

A Ray started here keeps SIGTERM and SIGINT blocked in every process it runs (`stop_signals_held`), so a
stop that signals every process at once reaches this process alone (docs/operations.md#a-planned-stop-sigterm).
"""

import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from deployments.config import AuthSettings
from serve_app.args import AppArgs
from serve_app.ray_network import keep_local_ray_on_loopback

HttpEntry = Literal["ingress", "proxy"]
HTTP_ENTRIES: tuple[HttpEntry, ...] = ("ingress", "proxy")
LISTEN_TIMEOUT_S = 60.0  # the replica is RUNNING by then; its server starts as it finishes initializing


def init_ray(entry: HttpEntry, port: int, **ray_init_options: object) -> None:
    """Start Ray here (or join RAY_ADDRESS) with the job environment Serve's controller and replicas need.
    A Ray started here is single-machine: every one of its ports on 127.0.0.1 (serve_app/ray_network.py)."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        keep_local_ray_on_loopback()
    import ray

    from serve_app.serve_env import cluster_runtime_env

    runtime_env = cluster_runtime_env(port if entry == "ingress" else None)
    with stop_signals_held():
        # "local": a Ray of its own, never the cluster a `ray start` last recorded (Ray's default for None)
        ray.init(address=address or "local", namespace="serve", runtime_env=runtime_env, **ray_init_options)


@contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT blocked while Ray starts its processes, which inherit the mask across fork and exec
    (its workers and their children through the raylet): a supervisor that signals every process at once
    (systemd's KillMode=control-group, a process-group kill, pkill) then stops only this one, which drains
    and shuts Serve and Ray down in order. Signalled themselves, the raylet and the GCS went first: the
    node's death ended every replica at once, cutting the streams, or the driver waited a minute on a GCS
    that had stopped answering. A signal sent meanwhile reaches this process when Ray has started."""
    if not hasattr(signal, "pthread_sigmask"):  # no POSIX signal masks (Windows): nothing to hold
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def run_graph(args: AppArgs, entry: HttpEntry, app_name: str, auth: AuthSettings | None = None) -> str:
    """Start Serve and run the graph; returns the base URL once it answers there. `auth`: the key digests
    already read (build_graph)."""
    import ray
    from ray import serve

    from serve_app.app import build_graph

    ingress_node_ip = ray.util.get_node_ip_address() if entry == "ingress" else None
    graph = build_graph(args, ingress_node_ip=ingress_node_ip, auth=auth)  # its checks refuse before Serve starts
    serve.start(http_options={"host": args.host, "port": args.port if entry == "proxy" else 0})
    serve.run(graph, name=app_name, route_prefix="/", blocking=False)
    if entry == "ingress":
        wait_listening(args.host, args.port, LISTEN_TIMEOUT_S)
    return f"http://{args.host}:{args.port}/v1"


def wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Wait for the Ingress replica's own server to accept connections on (host, port)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((target, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ingress replica is not listening on {host}:{port}; if Serve was already running on "
                    f"this cluster its controller lacks direct ingress: use --http-entry proxy"
                ) from None
            time.sleep(0.1)
