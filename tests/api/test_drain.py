"""A planned stop at the Ingress (deployments/ingress/http/drain.py), over the real in-process renderer and
engine: once draining, new work gets 503 with Retry-After in each route's format and /health says
"draining"; a reply in flight finishes within the grace; what outlasts it ends as its route ends a failed
reply (OpenAI's error chunk then `[DONE]`, Responses' `response.failed`), never cut at the socket.
(Anthropic's stream frames the same failure as `event: error`; no Messages body asks for a reply long
enough to outlast a grace here, so its 503 is what this file checks.) tests/e2e/test_cli_serve_e2e.py runs it through SIGTERM.
"""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.drain import Drain
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.thread import EngineLoop
from serve_app.args import AppArgs
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER

LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
STREAMS: list[tuple[str, dict]] = [  # a reply far longer than the grace, in each family that can ask for one
    ("/v1/chat/completions", {"messages": USER, **LONG}),
    ("/v1/completions", {"prompt": "The capital of France is", **LONG}),
    ("/v1/responses", {"input": USER[0]["content"], "max_output_tokens": 1500, "ignore_eos": True, "stream": True}),
]


@pytest.fixture
def served(served_model: str) -> Iterator[tuple[TestClient, Drain, LocalBackend]]:
    model_dir = AppArgs(model=served_model).model_dir
    config = EngineConfig(model=str(model_dir), context=2048, kv_cache_gib=0.05, device="cpu", parallel=4)
    loop = EngineLoop(Engine(config))
    loop.start()
    backend = LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop)
    drain = Drain()
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]), drain=drain)
    try:
        with TestClient(app) as client:
            yield client, drain, backend
    finally:
        loop.shutdown()


def _events(client: TestClient, route: str, body: dict, opened: threading.Semaphore) -> list[str]:
    """Every `data:` and `event:` line of the stream; `opened` is released at its first event."""
    lines: list[str] = []
    with client.stream("POST", route, json=body) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith(("data: ", "event: ")):
                if not lines:
                    opened.release()
                lines.append(line)
    return lines


def _drain_now(drain: Drain, backend: LocalBackend, grace_s: float) -> str:
    return asyncio.run(drain.run(grace_s, backend.end_requests))


def test_streams_that_outlast_the_grace_end_with_their_routes_error_event(served: Any) -> None:
    client, drain, backend = served
    opened = threading.Semaphore(0)
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_events, client, route, body, opened) for route, body in STREAMS]
        for _ in STREAMS:
            assert opened.acquire(timeout=60)
        outcome = pool.submit(_drain_now, drain, backend, 0.3)
        chat, completion, responses = (stream.result(timeout=60) for stream in streams)
    assert outcome.result() == "drained: 0 request(s) finished, 3 ended after 0.3 s, 0 left"
    shutting_down = {"message": "the server is shutting down", "type": "server_error", "param": None, "code": None}
    for openai_stream in (chat, completion):
        assert json.loads(openai_stream[-2].removeprefix("data: ")) == {"error": shutting_down}
        assert openai_stream[-1] == "data: [DONE]"
    assert responses[-2] == "event: response.failed"
    failed = json.loads(responses[-1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "the server is shutting down"
    deadline = time.monotonic() + 10
    while backend.loop.info().running:  # the engine drops them too (its snapshot says so after its next turn)
        assert time.monotonic() < deadline, backend.loop.info()
        time.sleep(0.02)


def test_a_reply_in_flight_finishes_within_the_grace(served: Any) -> None:
    client, drain, backend = served
    opened = threading.Semaphore(0)
    body = {"messages": USER, "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(_events, client, "/v1/chat/completions", body, opened)
        assert opened.acquire(timeout=60)
        outcome = pool.submit(_drain_now, drain, backend, 60.0)
        events = stream.result(timeout=60)
    assert outcome.result() == "drained: 1 request(s) in flight finished"
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "route, body, envelope",
    [
        ("/v1/chat/completions", {"messages": USER}, {"type": "server_error", "param": None, "code": None}),
        ("/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 4}, {"type": "overloaded_error"}),
        ("/v1/responses", {"input": "hi"}, {"type": "server_error", "param": None, "code": None}),
        ("/tokenize", {"prompt": "hi"}, {"type": "server_error", "param": None, "code": None}),
    ],
)
def test_while_draining_new_work_gets_503_with_retry_after(served: Any, route: str, body: dict, envelope: dict) -> None:
    client, drain, _ = served
    drain.draining = True
    reply = client.post(route, json=body)
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
    error = reply.json()["error"]
    assert error == {"message": "the server is shutting down; retry in a few seconds", **envelope}
    health = client.get("/health")
    assert health.status_code == 503 and health.headers["Retry-After"] == "5"
    assert health.json() == {"status": "draining", "message": "the server is shutting down"}
    assert client.get("/v1/models").status_code == 200  # reads that start no work still answer
