"""Server-sent events framing for the OpenAI-style streams: `data: <json>` events, then `data: [DONE]`."""

import json
from typing import Any

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def sse_done() -> bytes:
    return b"data: [DONE]\n\n"


def sse_error(message: str, type: str = "server_error") -> bytes:
    """The error event a stream sends when generation fails after it opened (then [DONE])."""
    return sse_event({"error": {"message": message, "type": type, "param": None, "code": None}})
