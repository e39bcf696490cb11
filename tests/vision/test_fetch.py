"""Fetching image URLs safely: the public-address rule (a resolver stub), and a local HTTPS server on
127.0.0.1 proving loopback is refused, redirects are checked hop by hop and capped, and bodies are capped."""

import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deployments.renderer.vision.addresses import refused_reason
from deployments.renderer.vision.fetch import FetchError, UrlFetcher
from tests.vision.conftest import encoded, random_image

PNG = encoded(random_image(16, 16))


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("169.254.10.1", "link-local"),
        ("fe80::1", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:10.0.0.1", "private"),
        ("100.64.0.1", "non-public"),
        ("240.0.0.1", "private"),
        ("not-an-address", "malformed"),
        ("93.184.216.34", None),
        ("2606:4700:4700::1111", None),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_public_address_rule(address: str, reason: str | None) -> None:
    assert refused_reason(address) == reason


def _fetcher(resolved: dict[str, list[str]], **kwargs: object) -> UrlFetcher:
    """A fetcher whose resolver is a table (a name it lacks does not resolve)."""
    return UrlFetcher(
        max_bytes=int(kwargs.pop("max_bytes", 1 << 20)),
        connect_timeout_s=2.0,
        read_timeout_s=2.0,
        resolver=lambda host, port: resolved.get(host, []),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("address", ["10.0.0.7", "169.254.169.254", "::1", "fd00:ec2::254"])
def test_stub_resolver_private_addresses_refused_before_connecting(address: str) -> None:
    fetcher = _fetcher({"images.example.com": ["93.184.216.34", address]})  # one bad address is enough
    with pytest.raises(FetchError, match=r"resolves to a .* address"):
        fetcher.fetch("https://images.example.com/cat.png")


def test_only_https_and_no_credentials() -> None:
    fetcher = _fetcher({})
    with pytest.raises(FetchError, match="must be https"):
        fetcher.fetch("http://images.example.com/cat.png")
    with pytest.raises(FetchError, match="credentials"):
        fetcher.fetch("https://user:pw@images.example.com/cat.png")
    with pytest.raises(FetchError, match="does not resolve"):
        fetcher.fetch("https://nowhere.example.com/cat.png")


class _Handler(BaseHTTPRequestHandler):
    """/image.png: a PNG; /big: more than the cap; /loop: redirects to itself; /to-private: to 10.0.0.1;
    /hop/N: N + 1 redirects, then the PNG."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/image.png":
            return self._send(200, PNG)
        if self.path == "/big":
            return self._send(200, b"\0" * 5000, length=False)
        if self.path == "/loop":
            return self._send(302, b"", location="/loop")
        if self.path == "/to-private":
            return self._send(302, b"", location="https://10.0.0.1/image.png")
        if self.path.startswith("/hop/"):
            left = int(self.path.rsplit("/", 1)[1])
            return self._send(302, b"", location=f"/hop/{left - 1}" if left else "/image.png")
        return self._send(404, b"")

    def _send(self, status: int, body: bytes, location: str | None = None, length: bool = True) -> None:
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A certificate for `localhost` and 127.0.0.1, made with `cryptography`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, ssl.SSLContext]]:
    """A local HTTPS server on 127.0.0.1, and a client context trusting its certificate."""
    cert, key = _self_signed(tmp_path_factory.mktemp("tls"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], ssl.create_default_context(cafile=str(cert))
    finally:
        server.shutdown()
        server.server_close()


def _loopback_allowed(address: str) -> str | None:
    """The real rule, except that this test's server on 127.0.0.1 counts as public."""
    return None if address == "127.0.0.1" else refused_reason(address)


def test_loopback_server_refused(https_server: tuple[int, ssl.SSLContext]) -> None:
    """With the real rule, the real resolver and a certificate the client trusts, 127.0.0.1 is refused."""
    port, trusting = https_server
    fetcher = UrlFetcher(max_bytes=1 << 20, connect_timeout_s=2, read_timeout_s=2, ssl_context=trusting)
    for host in ("localhost", "127.0.0.1"):
        with pytest.raises(FetchError, match="loopback address"):
            fetcher.fetch(f"https://{host}:{port}/image.png")
    allowed = _fetcher({"localhost": ["127.0.0.1"]}, ssl_context=trusting, allow=_loopback_allowed)
    assert allowed.fetch(f"https://localhost:{port}/image.png") == PNG  # the same server, the rule relaxed


def test_pinned_address_keeps_the_host_name_for_tls(https_server: tuple[int, ssl.SSLContext]) -> None:
    """The connection goes to the checked address while TLS verifies the URL's host: a certificate that does
    not name the host fails even though the address is the right one."""
    port, trusting = https_server
    fetcher = _fetcher({"images.example.com": ["127.0.0.1"]}, ssl_context=trusting, allow=_loopback_allowed)
    with pytest.raises(FetchError, match="could not be read"):
        fetcher.fetch(f"https://images.example.com:{port}/image.png")


def test_redirects_checked_and_capped(https_server: tuple[int, ssl.SSLContext]) -> None:
    port, trusting = https_server
    fetcher = _fetcher({"localhost": ["127.0.0.1"]}, ssl_context=trusting, allow=_loopback_allowed)
    base = f"https://localhost:{port}"
    assert fetcher.fetch(f"{base}/hop/1") == PNG  # two redirects
    assert fetcher.fetch(f"{base}/hop/2") == PNG  # three redirects: the most allowed
    with pytest.raises(FetchError, match="redirects more than 3 times"):
        fetcher.fetch(f"{base}/hop/3")
    with pytest.raises(FetchError, match="redirects more than 3 times"):
        fetcher.fetch(f"{base}/loop")
    with pytest.raises(FetchError, match=r"resolves to a private address \(10\.0\.0\.1\)"):
        fetcher.fetch(f"{base}/to-private")
    with pytest.raises(FetchError, match="answered HTTP 404"):
        fetcher.fetch(f"{base}/missing")


def test_byte_cap(https_server: tuple[int, ssl.SSLContext]) -> None:
    port, trusting = https_server
    small = _fetcher({"localhost": ["127.0.0.1"]}, ssl_context=trusting, allow=_loopback_allowed, max_bytes=4096)
    with pytest.raises(FetchError, match="larger than 4096 bytes"):
        small.fetch(f"https://localhost:{port}/big")  # no Content-Length: counted while streaming
    tiny = _fetcher({"localhost": ["127.0.0.1"]}, ssl_context=trusting, allow=_loopback_allowed, max_bytes=16)
    with pytest.raises(FetchError, match="larger than 16 bytes"):
        tiny.fetch(f"https://localhost:{port}/image.png")  # its Content-Length says so first
