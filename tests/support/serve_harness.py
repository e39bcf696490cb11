"""Deploying the repo's Serve config YAMLs into the test session's Serve instance, as `serve run` does."""

import os
import time
from pathlib import Path
from typing import Any

import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
APP_START_TIMEOUT_S = 240.0


def load_app_config(config_name: str, app_name: str, route_prefix: str, **args: Any) -> dict[str, Any]:
    """One application of configs/<config_name>, renamed and re-prefixed, its args updated.

    The session's apps share one Serve and its proxy, so each is reached through the proxy (`http_entry`),
    whatever entry the YAML's own controller settings give it under `serve run`.
    """
    config = yaml.safe_load((CONFIGS / config_name).read_text())
    (app,) = config["applications"]
    merged = {**app.get("args", {}), "http_entry": "proxy", **args}
    return {**app, "name": app_name, "route_prefix": route_prefix, "args": merged}


# Every application deployed here and not yet deleted: a declarative deploy replaces the whole set (Serve
# deletes the config's applications it no longer lists), so each deploy lists these too, unchanged.
_DEPLOYED: dict[str, dict[str, Any]] = {}


def deploy_apps(apps: list[dict[str, Any]]) -> None:
    """Deploy applications declaratively, as `serve run config.yaml` does, beside the session's others
    (the shared tiny-glm app among them), and wait for RUNNING."""
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    client = serve_start()  # the running instance
    _DEPLOYED.update({app["name"]: app for app in apps})
    client.deploy_apps(ServeDeploySchema(applications=list(_DEPLOYED.values())))
    names = {app["name"] for app in apps}
    deadline = time.monotonic() + APP_START_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = {name: serve.status().applications.get(name) for name in names}
        states = {name: (s.status if s else "MISSING") for name, s in statuses.items()}
        failed = {n: statuses[n].message for n, st in states.items() if st == "DEPLOY_FAILED"}
        if failed:
            for name in names:  # not listed again by the next deploy
                _DEPLOYED.pop(name, None)
            raise RuntimeError(f"applications failed to deploy: {failed}")
        if all(st == "RUNNING" for st in states.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"applications not RUNNING after {APP_START_TIMEOUT_S:.0f} s: {states}")


def delete_apps(names: list[str]) -> None:
    from ray import serve

    for name in names:
        _DEPLOYED.pop(name, None)
        serve.delete(name)


def listener_of(port: int) -> str:
    """The command line of the process holding the listening TCP socket on `port` (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:  # gone, or not ours to read
            continue
    return ""


def process_tree(root_pid: int) -> list[Any]:
    """The process and every descendant (Ray's GCS, raylet, agents and workers under a server it started)."""
    import psutil

    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def listening_sockets(processes: list[Any]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket and bound UDP socket the processes hold."""
    import psutil

    found = []
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
            name = " ".join(process.cmdline()[:1]) or process.name()
        except psutil.NoSuchProcess:
            continue
        for conn in connections:
            if conn.status in (psutil.CONN_LISTEN, psutil.CONN_NONE) and conn.laddr:
                found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


def time_wait_on(port: int) -> int:
    """TIME_WAIT sockets (state 06) whose local port is `port`: the server closed those connections first."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            count += int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "06"
    return count


def closed_by_the_server(port: int, path: str = "/health") -> bytes:
    """One request asking the server to close; read to its end of stream before closing, so the server's
    side closes first (and lingers in TIME_WAIT on `port`). Returns the reply."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply
