"""client_disconnections_total counts every client that leaves a streamed reply, once: before its reply
finished upstream (the request is cancelled) or after (a short reply often is), on each streaming family.

The app is driven as an ASGI server would drive it for a client that reads some of the stream and goes:
the next send fails and receive() says the client disconnected. No timing decides anything: each case
waits for the count it expects (or a count past it, which fails).
"""

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER
from tests.support.local_app import local_backend

SHORT = {"messages": USER, "max_tokens": 2, "temperature": 0, "stream": True}
LONG = {"messages": USER, "max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}
STREAMS = {
    "/v1/chat/completions": SHORT,
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "stream": True},
    "/v1/messages": {**SHORT, "max_tokens": 2},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 2, "stream": True},
}


@pytest.fixture(scope="module")
def backend(served_model: str) -> Iterator[LocalBackend]:
    with local_backend(served_model) as value:
        yield value


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _read_then_leave(app: Any, path: str, body: dict[str, Any], pieces: int | None) -> list[bytes]:
    """The body pieces a client got that read `pieces` of them (None: all) and then disconnected."""
    got: list[bytes] = []
    gone = asyncio.Event()
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set():
            raise OSError("the client is gone")
        if message["type"] == "http.response.body" and message.get("body"):
            got.append(message["body"])
            if pieces is not None and len(got) >= pieces:
                gone.set()

    try:
        await app(_scope(path), receive, send)
    except OSError:
        pass
    return got


def _departures(backend: LocalBackend) -> int:
    (status,) = asyncio.run(backend.replicas())
    return status.counters.requests_aborted_total


def _settle(backend: LocalBackend, expected: int) -> int:
    """The count once it reaches `expected` and the engine is idle (or what it is after 20 s)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        (status,) = asyncio.run(backend.replicas())
        if status.counters.requests_aborted_total >= expected and status.running == 0 and status.waiting == 0:
            break
        time.sleep(0.05)
    time.sleep(0.2)  # a double count would land by now
    return _departures(backend)


def _run(backend: LocalBackend, path: str, body: dict[str, Any], pieces: int | None, times: int = 1) -> None:
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))

    async def all_of_them() -> None:
        for _ in range(times):
            got = await _read_then_leave(app, path, body, pieces)
            assert got, path
            if pieces is None:
                assert got[-1].rstrip().endswith((b"[DONE]", b'message_stop"}', b"}")), got[-1][-80:]
        # The asyncio finaliser closes a stream the server dropped, and the report runs in a task of its
        # own: wait for every other task (asyncio.run would cancel them).
        deadline = time.monotonic() + 30
        while len(asyncio.all_tasks()) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    asyncio.run(all_of_them())


@pytest.mark.parametrize("path", list(STREAMS))
def test_short_replies_left_after_their_first_piece_are_each_counted_once(backend: LocalBackend, path: str) -> None:
    before = _departures(backend)
    _run(backend, path, STREAMS[path], pieces=1, times=6)
    assert _settle(backend, before + 6) == before + 6


def test_a_reply_read_to_its_end_is_not_a_disconnection(backend: LocalBackend) -> None:
    before = _departures(backend)
    for path, body in STREAMS.items():
        _run(backend, path, body, pieces=None)
    assert _settle(backend, before) == before


def test_a_long_reply_left_midway_is_cancelled_and_counted_once(backend: LocalBackend) -> None:
    before = _departures(backend)
    _run(backend, "/v1/chat/completions", LONG, pieces=3)
    assert _settle(backend, before + 1) == before + 1
    (status,) = asyncio.run(backend.replicas())
    assert status.running == 0 and status.kv_usage == 0  # cancelled upstream, its blocks freed
