"""Server-sent events framing for the OpenAI-style streams: `data: <json>` events, then `data: [DONE]`."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger("tensorfold.ingress")

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream


# One event as /openapi.json documents it (OpenAPI 3.1: a stream's `schema` describes each event).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string", "description": "the event's name, where the family names its events"},
        "data": {"type": "string", "description": "a JSON object, or [DONE] ending an OpenAI stream"},
    },
}


def streamed_reply(what: str, event: dict[str, Any] = SSE_EVENT_SCHEMA, body: Any = None) -> dict[int | str, Any]:
    """A route's documented 200: one JSON body, or with `stream` server-sent events (`event` describes each;
    `body` the JSON, default any object)."""
    json_body = {"type": "object"} if body is None else body
    content = {"application/json": {"schema": json_body}, SSE_MEDIA_TYPE: {"schema": event}}
    return {200: {"description": what, "content": content}}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_done() -> bytes:
    return b"data: [DONE]\n\n"


def sse_error(message: str, type: str = "server_error") -> bytes:
    """The error event a stream sends when generation fails after it opened (then [DONE])."""
    return sse_event({"error": {"message": message, "type": type, "param": None, "code": None}})


async def counting_departures(
    body: AsyncIterator[bytes], client_left: Callable[[], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """`body`'s pieces; a client that leaves before the last one went out is reported to `client_left`,
    once, after `body` has cleaned up (cancelling its request upstream if it still runs)."""
    left = False
    try:
        async for piece in body:
            yield piece
    except (GeneratorExit, asyncio.CancelledError):  # the server closes a stream whose client went away
        left = True
        raise
    finally:
        await body.aclose()  # type: ignore[attr-defined]
        if left:  # in a task of its own: this one is being cancelled, and would cancel the report with it
            report = asyncio.get_running_loop().create_task(_report(client_left))
            _REPORTS.add(report)
            report.add_done_callback(_REPORTS.discard)


_REPORTS: set[asyncio.Task[None]] = set()  # reports in flight (the loop keeps only weak references)


async def _report(client_left: Callable[[], Awaitable[None]]) -> None:
    try:
        await client_left()
    except Exception:  # no replica to tell: the count is lost, nothing else
        log.warning("could not count a client that left", exc_info=True)
