"""Guards against hostile bodies, applied before any route reads one: size (413) and JSON nesting (400).

The size limit (`max_body_bytes`, 16 MiB by default) is checked on Content-Length before the body is
read; a chunked body is counted as it arrives and refused at the first byte over. Nesting is checked
after parsing (`json_depth`), because templates, schemas and grammars recurse over what a client sends.
Errors come in the route's own format: Anthropic's envelope on `/v1/messages*`, OpenAI's elsewhere
(built here, not imported from errors.py, which imports this module).
"""

import re
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.config import DEFAULT_MAX_BODY_BYTES

MAX_JSON_DEPTH = 64
_LENGTH_DIGITS = 18  # a Content-Length of more digits is over any body limit (10^18 bytes is an exabyte)
ANTHROPIC_PREFIX = "/v1/messages"
# Our error kind -> (OpenAI type, OpenAI code, Anthropic type).
_KINDS = {
    "auth": ("invalid_request_error", "invalid_api_key", "authentication_error"),
    "too_large": ("invalid_request_error", "request_too_large", "request_too_large"),
    "invalid": ("invalid_request_error", None, "invalid_request_error"),
    "unavailable": ("server_error", None, "overloaded_error"),  # a planned stop: retry elsewhere, or later
}


def route_path(scope: Scope) -> str:
    """The path the app routes on: Serve's route prefix (root_path) removed."""
    path: str = scope.get("path", "/")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def path_error(path: str, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the envelope of the route at `path`."""
    openai_type, code, anthropic_type = _KINDS[kind]
    if is_anthropic(path):
        body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        body = {"error": {"message": message, "type": openai_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest  # enough to refuse; no need to walk the rest
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def _content_length(scope: Scope) -> int | None | str:
    """The header's byte count; "bad" when it is no number. Read by its digits first: any value of more than
    `_LENGTH_DIGITS` is over every limit, and `int` raises past 4,300 digits."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not text.isascii() or not text.isdigit():  # "²" is a digit to isdigit, not to int
                return "bad"
            return int(text) if len(text.lstrip("0")) <= _LENGTH_DIGITS else 10**_LENGTH_DIGITS
    return None


class BodyLimitMiddleware:
    """Refuses bodies over `max_bytes` with 413 before the route runs."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        length = _content_length(scope)
        if length == "bad":
            await path_error(path, 400, "invalid", "the Content-Length header is not a number")(scope, receive, send)
        elif isinstance(length, int) and length > self.max_bytes:
            await self._too_large(path, scope, receive, send)
        elif length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            await self._buffered(path, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _too_large(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await path_error(path, 413, "too_large", message, {"Connection": "close"})(scope, receive, send)

    async def _buffered(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """A body without Content-Length (chunked): read it under the cap, then replay it to the app."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(path, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # afterwards: the disconnect, as the app expects

    return replay


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate_path(raw: bytes, value: Any) -> str | None:
    """Where parsed JSON holds a lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer can encode.
    Walked only when the raw body has a surrogate escape at all, so ordinary bodies cost one regex scan."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, where))
                name = str(key).encode("utf-8", "backslashreplace").decode()  # the path is answered as UTF-8
                stack.append((child, f"{where}.{name}" if where else name))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return None
