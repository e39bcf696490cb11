"""Fetching an image from a public `https://` URL without letting a client reach what it should not.

Every hop (the URL, then at most MAX_REDIRECTS redirects) must be https; its host's addresses are resolved
once, every one must be public (addresses.py's rule), and the connection goes to the address that was
checked, while TLS still verifies the certificate for the host name (SNI), so a name that resolves
differently a moment later (DNS rebinding) gains nothing. The body is read in a stream under a byte cap,
with connect and read timeouts.
"""

import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urljoin, urlsplit

import httpcore

from deployments.renderer.vision.addresses import refused_reason

MAX_REDIRECTS = 3
REDIRECTS = (301, 302, 303, 307, 308)
RESOLVE_TIMEOUT_S = 5.0
Resolver = Callable[[str, int], list[str]]
_RESOLVERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="image-dns")


class FetchError(Exception):
    """An image URL the server will not read, or could not (the message says which rule or failure)."""


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system's resolver gives for `host`, within RESOLVE_TIMEOUT_S (getaddrinfo has no
    timeout of its own, so it runs on a worker thread that a stuck lookup cannot hold the request on)."""
    lookup = _RESOLVERS.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=RESOLVE_TIMEOUT_S)
    except TimeoutError:
        raise FetchError(f"the image URL's host {host!r} did not resolve in time") from None
    except OSError:
        raise FetchError(f"the image URL's host {host!r} does not resolve") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class PinnedBackend(httpcore.NetworkBackend):
    """Connects to a host's checked address: resolve, refuse any address that is not public, connect to it."""

    def __init__(self, resolver: Resolver, allow: Callable[[str], str | None] = refused_reason) -> None:
        self._resolver = resolver
        self._refused = allow
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = [host.strip("[]")] if _is_address(host) else self._resolver(host, port)
        if not addresses:
            raise FetchError(f"the image URL's host {host!r} does not resolve")
        for address in addresses:
            reason = self._refused(address)
            if reason is not None:
                raise FetchError(f"the image URL's host {host!r} resolves to a {reason} address ({address})")
        return self._inner.connect_tcp(addresses[0], port, timeout, local_address, socket_options)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class UrlFetcher:
    """One image URL's bytes (`fetch`), under the caps; a FetchError names every refusal."""

    def __init__(
        self,
        max_bytes: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        resolver: Resolver = system_resolver,
        ssl_context: ssl.SSLContext | None = None,
        allow: Callable[[str], str | None] = refused_reason,
    ) -> None:
        self.max_bytes = max_bytes
        self._timeouts = {"connect": connect_timeout_s, "read": read_timeout_s, "write": read_timeout_s}
        self._timeouts["pool"] = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._backend = PinnedBackend(resolver, allow)
        self._ssl = ssl_context or ssl.create_default_context()

    def fetch(self, url: str) -> bytes:
        """Follow at most MAX_REDIRECTS redirects, each hop checked, then read the body under the cap."""
        with httpcore.ConnectionPool(ssl_context=self._ssl, network_backend=self._backend, retries=0) as pool:
            for _ in range(MAX_REDIRECTS + 1):
                _check_https(url)
                location, body = self._hop(pool, url)
                if location is None:
                    return body
                url = urljoin(url, location)
        raise FetchError(f"the image URL redirects more than {MAX_REDIRECTS} times")

    def _hop(self, pool: httpcore.ConnectionPool, url: str) -> tuple[str | None, bytes]:
        """One request: a redirect's Location, or None and the body."""
        headers = [(b"Accept", b"image/png, image/jpeg, image/webp, image/gif"), (b"User-Agent", b"tensorfold")]
        try:
            with pool.stream("GET", url, headers=headers, extensions={"timeout": self._timeouts}) as reply:
                if reply.status in REDIRECTS:
                    location = _header(reply.headers, b"location")
                    if not location:
                        raise FetchError(f"the image URL answered HTTP {reply.status} without a Location")
                    return location, b""
                if reply.status != 200:
                    raise FetchError(f"the image URL answered HTTP {reply.status}")
                return None, self._read(reply)
        except httpcore.TimeoutException:
            raise FetchError("the image URL's server did not answer in time") from None
        except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, OSError) as exc:
            raise FetchError(f"the image URL could not be read ({type(exc).__name__})") from None

    def _read(self, reply: httpcore.Response) -> bytes:
        """The body, refused as soon as it passes the cap (or its declared length does), or takes too long."""
        declared = _header(reply.headers, b"content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise FetchError(f"the image is larger than {self.max_bytes} bytes")
        deadline = time.monotonic() + self._read_timeout_s  # the whole body, not just each read
        chunks, size = [], 0
        for chunk in reply.iter_stream():
            size += len(chunk)
            if size > self.max_bytes:
                raise FetchError(f"the image is larger than {self.max_bytes} bytes")
            if time.monotonic() > deadline:
                raise FetchError("the image URL's server did not send the image in time")
            chunks.append(chunk)
        return b"".join(chunks)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _check_https(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme.lower() != "https" or not parts.hostname:
        raise FetchError(f"image URLs must be https:// (got {url[:80]!r})")
    if parts.username or parts.password:
        raise FetchError("image URLs may not carry credentials")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    value = next((v for k, v in headers if k.lower() == name), None)
    return value.decode("latin-1").strip() if value is not None else None
