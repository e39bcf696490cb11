"""Route protection: which paths need a key, checking the key presented, and the request log line.

With keys configured every path needs one (default deny, so a route added later is protected too)
except `/health` and `/` (answered as `{"status":"ok"}` only) and, with `--metrics-open`, `/metrics`
and `/v1/metrics`. The accepted key's label is put on the request state (`request.state.key_label`)
for the request log and the metrics' label; the key and its digest never leave this module. The access
line escapes what the client sent (`escaped`, http/finish_log.py) and shows a failure's 500 too.
"""

import logging
import time
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.ingress.http.finish_log import escaped
from deployments.ingress.http.key_store import KeyStore
from deployments.ingress.http.limits import path_error, route_path

log = logging.getLogger("tensorfold.access")
HEALTH_PATHS = ("/health", "/")
METRICS_PATHS = ("/metrics", "/v1/metrics")


def presented_key(scope: Scope) -> str | None:
    """`Authorization: Bearer KEY` (scheme case-insensitive) or else `x-api-key: KEY`."""
    bearer: str | None = None
    api_key: str | None = None
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                bearer = token.strip()
        elif name == b"x-api-key" and value.strip():
            api_key = value.decode("latin-1").strip()
    return bearer or api_key


class AuthMiddleware:
    """Pure ASGI (no body buffering), so streamed replies pass straight through."""

    def __init__(self, app: ASGIApp, store: KeyStore, metrics_open: bool = False) -> None:
        self.app = app
        self.store = store
        self.metrics_open = metrics_open

    def is_open(self, path: str) -> bool:
        return path in HEALTH_PATHS or (self.metrics_open and path in METRICS_PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        state = scope.setdefault("state", {})
        state["key_label"] = None
        if not self.store.enabled:
            await self._logged(scope, receive, send, path)
            return
        if path in HEALTH_PATHS:
            state["health_minimal"] = True  # the route answers {"status":"ok"} and nothing more
        if not self.is_open(path):
            refusal = self._check(scope, path)
            if refusal is not None:
                log.info("%s %s status=401 key=-", escaped(str(scope.get("method"))), escaped(path))
                await refusal(scope, receive, send)
                return
        await self._logged(scope, receive, send, path)

    def _check(self, scope: Scope, path: str) -> Callable[[Scope, Receive, Send], Awaitable[None]] | None:
        """None when the key presented is accepted (its label set on the state), else the 401 to send."""
        keys = self.store.keys()
        presented = presented_key(scope)
        if keys is None:
            message = "authentication is unavailable: the server's key file is invalid or being replaced"
        elif presented is None:
            message = "missing API key: send Authorization: Bearer KEY or x-api-key: KEY"
        else:
            label = keys.match(presented)
            if label is not None:
                scope["state"]["key_label"] = label
                return None
            message = "invalid API key"
        return path_error(path, 401, "auth", message, {"WWW-Authenticate": "Bearer"})

    async def _logged(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Run the route; log one line with its status and the key's label when the reply ends."""
        started = time.monotonic()
        status = 0

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = status or 500  # the error handler answers it outside this middleware
            raise
        finally:
            label = scope["state"].get("key_label") or "-"
            log.info(
                "%s %s status=%s key=%s elapsed=%.3fs",
                escaped(str(scope.get("method"))),
                escaped(path),  # decoded: %0A, %0D and %1b would forge lines and pass terminal escapes
                status or "-",
                label,
                time.monotonic() - started,
            )
