"""Ray Serve's data-path settings the graph runs with, set through the environment Serve reads them from.

Serve reads these once, when a process imports it, so they must be in a process's environment when it
starts. Replicas get `replica_env()` in their actor options (build_app), which covers `serve run
configs/glm.yaml`. A process that starts the Ray cluster itself (`tensorfold serve`, `tensorfold bench
serve`, the tests) also passes `cluster_runtime_env()` to `ray.init`: the job's runtime environment
reaches Serve's controller and, through it, the HTTP proxy and the replicas, while the starting process
keeps Serve's defaults (its handles are used outside an event loop, which a shared-loop router forbids).
A variable already set in the environment wins over these defaults.

`tensorfold serve` also asks for Serve's direct ingress (`direct_ingress_env`): the Ingress replica runs
the HTTP server on the user's port itself, so a request skips the proxy actor's hop and the call the
replica otherwise makes back to the proxy for the request body. At 16 concurrent streams on a 2-core
machine that took the TTFT p50 the graph adds from 61-74 ms to 13-20 ms (docs/benchmarks.md).
"""

import os
from typing import Any

from deployments.config import DEFAULT_MAX_BODY_BYTES

GRPC_LIMIT_VAR = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"


def grpc_message_bytes(max_body_bytes: int) -> int:
    """The largest message a replica takes over Serve's gRPC path (gRPC's own default, 4 MiB, answered
    larger ones with RESOURCE_EXHAUSTED): a whole body travels from Ingress to the Renderer, pickled no
    larger than its JSON, and /tokenize's ids come back, at most one per body byte and 5 bytes pickled
    each; so six bodies and 8 MiB of room (gRPC's ceiling is 2 GiB)."""
    return min(6 * max_body_bytes + (8 << 20), (1 << 31) - 1)


REPLICA_DEFAULTS: dict[str, str] = {
    # Our handlers never block (the engine steps in its own process), so they share the replica's event
    # loop: no hand-off to a second loop thread for every call and every streamed chunk.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # A caller's router (Ingress picking a Scheduler replica, the proxy picking an Ingress) runs on that
    # same loop too.
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # Bodies up to max_body_bytes reach the Renderer (recomputed for the app's limit by `replica_env`).
    GRPC_LIMIT_VAR: str(grpc_message_bytes(DEFAULT_MAX_BODY_BYTES)),
}
PROXY_DEFAULTS: dict[str, str] = {
    # The HTTP proxy hands requests to Ingress and gets its ASGI messages back over gRPC, not object refs.
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}


def _with_overrides(defaults: dict[str, str]) -> dict[str, str]:
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def replica_env(max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, str]:
    """The env_vars for a deployment's runtime_env: the defaults (the gRPC limit for `max_body_bytes`),
    unless this environment sets them."""
    return _with_overrides({**REPLICA_DEFAULTS, GRPC_LIMIT_VAR: str(grpc_message_bytes(max_body_bytes))})


def direct_ingress_env(port: int) -> dict[str, str]:
    """What Serve's controller and the Ingress replica need for the replica to answer HTTP on `port` itself."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # The controller hands each node's Ingress replica a port from [MIN, MAX): here only `port`.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # No load balancer in front needs time to take the replica out: shutdown waits only for requests
        # in flight.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # A replacement Ingress replica may take the port back as soon as the old one has let it go.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
    }


def cluster_runtime_env(direct_ingress_port: int | None = None) -> dict[str, Any]:
    """The job runtime environment for `ray.init` in a process that starts the cluster; with a port, the
    Ingress replica answers HTTP there itself (direct ingress)."""
    defaults = {**REPLICA_DEFAULTS, **PROXY_DEFAULTS}
    if direct_ingress_port is not None:
        defaults.update(direct_ingress_env(direct_ingress_port))
    return {"env_vars": _with_overrides(defaults)}
