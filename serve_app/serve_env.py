"""Ray Serve's data-path settings the graph runs with, set through the environment Serve reads them from.

Serve reads these once, when a process imports it, so they must be in a process's environment when it
starts. Replicas get `replica_env()` in their actor options (build_app), which covers `serve run
configs/glm.yaml`. A process that starts the Ray cluster itself (`tensorfold serve`, `tensorfold bench
serve`, the tests) also passes `cluster_runtime_env()` to `ray.init`: the job's runtime environment
reaches Serve's controller and, through it, the HTTP proxy, while the starting process keeps Serve's
defaults (its handles are used outside an event loop, which a shared-loop router forbids). A variable
already set in the environment wins over these defaults.
"""

import os
from typing import Any

REPLICA_DEFAULTS: dict[str, str] = {
    # Our handlers never block (the engine steps in its own process), so they share the replica's event
    # loop: no hand-off to a second loop thread for every call and every streamed chunk.
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    # A caller's router (Ingress picking a Scheduler replica, the proxy picking an Ingress) runs on that
    # same loop too.
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
PROXY_DEFAULTS: dict[str, str] = {
    # The HTTP proxy hands requests to Ingress and gets its ASGI messages back over gRPC, not object refs.
    "RAY_SERVE_PROXY_USE_GRPC": "1",
}


def _with_overrides(defaults: dict[str, str]) -> dict[str, str]:
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def replica_env() -> dict[str, str]:
    """The env_vars for a deployment's runtime_env: the defaults, unless this environment sets them."""
    return _with_overrides(REPLICA_DEFAULTS)


def cluster_runtime_env() -> dict[str, Any]:
    """The job runtime environment for `ray.init` in a process that starts the cluster."""
    return {"env_vars": _with_overrides({**REPLICA_DEFAULTS, **PROXY_DEFAULTS})}
