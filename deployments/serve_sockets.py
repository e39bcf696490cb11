"""The sockets Serve opens inside each replica of this graph, made safe to expose and to restart.

Serve (ray 2.60) binds two sockets in a replica itself, after the deployment's constructor has run:
- the inter-deployment gRPC server (handles and the proxy reach the replica through it), on all
  interfaces ("[::]:0"). Callers dial it at the node's address, so it is bound there instead: on a
  single-machine Ray (node address 127.0.0.1) nothing of it is reachable from the network;
- the direct-ingress HTTP listener, without SO_REUSEADDR. A server that closes its side of a connection
  first leaves a TIME_WAIT socket on its port for about a minute, and Linux lets a new listener take the
  port only when both the old sockets and the new one set SO_REUSEADDR; so a restart on the same port
  failed for that minute. Never SO_REUSEPORT: that would let two live servers share the port.
Every deployment's constructor calls `configure_serve_sockets()`; outside a Serve replica it does nothing.
"""

import socket
from types import ModuleType
from typing import Any


class _ReuseAddressSockets(ModuleType):
    """Python's `socket` module, except that TCP sockets are created with SO_REUSEADDR set."""

    def __init__(self) -> None:
        super().__init__("socket")

    def __getattr__(self, name: str) -> object:
        return getattr(socket, name)

    @staticmethod
    def socket(*args: Any, **kwargs: Any) -> socket.socket:
        created = socket.socket(*args, **kwargs)
        if created.type == socket.SOCK_STREAM:
            created.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return created


def reuse_address_on_listen() -> None:
    """Sockets created by Serve's HTTP server code in this process set SO_REUSEADDR (idempotent)."""
    from ray.serve._private import http_util

    if not isinstance(http_util.socket, _ReuseAddressSockets):
        http_util.socket = _ReuseAddressSockets()


def node_bound(address: str, node_ip: str) -> str:
    """An all-interfaces gRPC address (`[::]:PORT`, `0.0.0.0:PORT`) on the node's address instead."""
    host, _, port = address.rpartition(":")
    if host not in ("[::]", "0.0.0.0", ""):
        return address
    return f"[{node_ip}]:{port}" if ":" in node_ip else f"{node_ip}:{port}"


def bind_grpc_to_node_address() -> None:
    """The replica's inter-deployment gRPC server binds the node's address, not every interface."""
    import ray
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "node_bound", False):
        return

    def add_port_on_node(server: Any, address: str) -> int:
        return add_port(server, node_bound(address, ray.util.get_node_ip_address()))

    add_port_on_node.node_bound = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port_on_node


def configure_serve_sockets() -> None:
    """In a Serve replica, before Serve opens its sockets (the deployment's constructor runs first)."""
    from ray.serve.context import _get_internal_replica_context

    if _get_internal_replica_context() is None:  # constructed directly (tests): Serve binds nothing here
        return
    bind_grpc_to_node_address()
    reuse_address_on_listen()
