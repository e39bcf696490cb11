"""Ray's ports at startup (serve_app/ray_network.py) and the Ingress listener's SO_REUSEADDR
(deployments/serve_sockets.py), without a Ray cluster."""

import asyncio
import socket
from itertools import product
from pathlib import Path

import pytest

from deployments.serve_sockets import node_bound
from serve_app.args import AppArgs
from serve_app.cli import build_parser
from serve_app.cli_serve import app_args_from
from serve_app.ray_network import RayExposure, _host_of, exposed_hosts, is_loopback_host, refusal, warning
from tests.conftest import free_port
from tests.support.serve_harness import time_wait_on

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost")
BEYOND = ("192.0.2.2", "0.0.0.0", "::", "fd00::2")


def test_loopback_includes_ipv4_mapped_and_names_but_not_wildcards() -> None:
    assert all(is_loopback_host(host) for host in LOOPBACK)
    assert not any(is_loopback_host(host) for host in BEYOND)


def test_addresses_reduce_to_their_hosts() -> None:
    assert _host_of("192.0.2.2:6379") == "192.0.2.2"
    assert _host_of("[fd00::2]:6379") == "fd00::2"
    assert _host_of("fd00::2") == "fd00::2" and _host_of("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize(
    ("token_auth", "hosts", "allowed"),
    list(product([False, True], [LOOPBACK, ("127.0.0.1", "192.0.2.2", "192.0.2.2"), ("::",)], [False, True])),
)
def test_startup_refuses_only_unauthenticated_ray_beyond_loopback_unless_allowed(
    token_auth: bool, hosts: tuple[str, ...], allowed: bool
) -> None:
    exposure = RayExposure(token_auth=token_auth, hosts=hosts)
    exposed = exposed_hosts(exposure)
    risky = not token_auth and bool(exposed)
    line = refusal(exposure, allowed)
    assert (line is not None) == (risky and not allowed)
    assert (warning(exposure, allowed) is not None) == (risky and allowed)
    if line is not None:
        assert "\n" not in line and f"listens on {', '.join(exposed)}:" in line
        assert "RAY_AUTH_MODE=token" in line and "--allow-unauthenticated-ray-network" in line
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 serve run" in line
    if hosts[1:2] == ("192.0.2.2",):
        assert exposed == ["192.0.2.2"]  # each address once


def test_the_risk_is_a_flag_and_a_yaml_key_off_by_default() -> None:
    assert AppArgs().allow_unauthenticated_ray_network is False
    assert AppArgs(allow_unauthenticated_ray_network=True).allow_unauthenticated_ray_network is True
    namespace = build_parser().parse_args(["serve", "builtin:tiny-glm", "--allow-unauthenticated-ray-network"])
    assert app_args_from(namespace).allow_unauthenticated_ray_network is True
    assert (
        app_args_from(build_parser().parse_args(["serve", "builtin:tiny-glm"])).allow_unauthenticated_ray_network
        is False
    )


async def _ok(scope: dict, receive: object, send: object) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_then_stop(port: int) -> None:
    """Serve's direct-ingress server on `port`; three requests asking to close, so the server closes first."""
    from ray.serve._private.http_util import start_asgi_http_server
    from ray.serve.config import HTTPOptions

    task, server = await start_asgi_http_server(
        _ok, HTTPOptions(host="127.0.0.1", port=port), event_loop=asyncio.get_running_loop()
    )
    while not server.started:
        await asyncio.sleep(0.01)
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).endswith(b"ok")  # read to EOF: the server closed its side
        writer.close()
    server.should_exit = True
    await task


def _restart(port: int) -> str | None:
    """Serve, stop, and serve again on the same port at once; the second start's error, or None."""
    asyncio.run(_serve_then_stop(port))
    assert time_wait_on(port) >= 1  # the old server's connections linger
    try:
        asyncio.run(_serve_then_stop(port))
    except RuntimeError as exc:
        return str(exc.__cause__ or exc)
    return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the socket table from Linux's /proc")
def test_the_ingress_listener_restarts_on_its_port_at_once() -> None:
    from ray.serve._private import http_util

    from deployments.serve_sockets import reuse_address_on_listen

    plain = http_util.socket
    try:
        assert "Address already in use" in (_restart(free_port()) or "")  # Serve's own bind: a minute's wait
        reuse_address_on_listen()
        reuse_address_on_listen()  # idempotent
        assert _restart(free_port()) is None
        with http_util.socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0  # never two servers on one port
    finally:
        http_util.socket = plain


def test_a_replicas_grpc_server_binds_the_node_address_instead_of_every_interface() -> None:
    assert node_bound("[::]:0", "127.0.0.1") == "127.0.0.1:0"
    assert node_bound("0.0.0.0:7", "192.0.2.2") == "192.0.2.2:7"
    assert node_bound("[::]:0", "fd00::2") == "[fd00::2]:0"
    assert node_bound("10.0.0.1:9", "127.0.0.1") == "10.0.0.1:9"  # an address already chosen stays
