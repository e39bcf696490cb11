"""What `tensorfold serve` checks before it starts Ray and listens: the port, the open-file limit, exposure.

The process that owns the listening socket (the Ingress replica, or Serve's proxy) is a Ray worker, which
inherits its limits from the raylet that this process starts; so the soft open-file limit is raised here,
before `ray.init`. A port already taken is reported here too, before Ray starts, rather than as a replica
that fails to start.
"""

import ipaddress
import logging
import socket

log = logging.getLogger("tensorfold.cli")
WANTED_OPEN_FILES = 65536


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE toward min(hard, wanted); returns (before, after), None if unsupported."""
    try:
        import resource
    except ImportError:  # not a Unix platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft, soft
        return soft, target
    return soft, soft


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and names resolving only to them (localhost); unresolvable names count as exposed."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def exposure_warning(host: str, keys_configured: bool) -> str | None:
    """The warning for a non-loopback bind without keys, or None."""
    if keys_configured or is_loopback(host):
        return None
    return (
        f"WARNING: listening on {host} without API keys: anyone who can reach this address can use the "
        "model. Set --api-key-file (a 0600 file) or TENSORFOLD_API_KEY, or bind 127.0.0.1."
    )


def port_taken(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on, or None when it can (a bind test, closed at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None
