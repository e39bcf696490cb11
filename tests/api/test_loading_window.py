"""The loading window at the Ingress: the routes answer before the engine has loaded, as under `tensorfold serve`.

The backend is the real in-process one (tiny-glm's renderer and engine), built before its engine exists, so
no replica answers yet: /health is 503 "loading", /v1/models lists nothing, a malformed request is still a 400
at once, and generation requests sent meanwhile wait. Once the engine has loaded and its loop is attached,
every one of them gets the reply it gets afterwards, /health is 200 and /v1/models lists the model. A request
that waits past `ready_wait_s` gets the 503 "the model is not ready". The window of a real `tensorfold serve`
is observed end to end in tests/e2e/test_cli_serve_e2e.py.
"""

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.keys import auth_settings
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.thread import EngineLoop
from serve_app.args import AppArgs
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER

NO_THINKING = {"max_tokens": 24, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


def _chat(raw: str) -> str:
    return json.loads(raw)["choices"][0]["message"]["content"]


def _chat_stream(raw: str) -> str:
    events = [json.loads(b[len("data: ") :]) for b in raw.split("\n\n") if b.startswith("data: {")]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def _completion(raw: str) -> str:
    return json.loads(raw)["choices"][0]["text"]


def _message(raw: str) -> str:
    return "".join(block.get("text", "") for block in json.loads(raw)["content"])


def _response(raw: str) -> str:
    items = json.loads(raw)["output"]
    return "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])


REQUESTS: list[tuple[str, dict, Callable[[str], str]]] = [  # each generation route, one of them streamed
    ("/v1/chat/completions", {"messages": USER, **NO_THINKING}, _chat),
    ("/v1/chat/completions", {"messages": USER, "stream": True, **NO_THINKING}, _chat_stream),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}, _completion),
    ("/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 24, "temperature": 0}, _message),
    (
        "/v1/responses",
        {
            "input": USER[0]["content"],
            "max_output_tokens": 24,
            "temperature": 0,
            "store": False,
            "reasoning": {"effort": "none"},
        },
        _response,
    ),
]


def _unloaded(served_model: str) -> tuple[LocalBackend, Any]:
    model_dir = AppArgs(model=served_model).model_dir
    return LocalBackend(PromptRenderer.from_checkpoint(model_dir), None), model_dir


def _load(model_dir: Any) -> EngineLoop:
    loop = EngineLoop(Engine(EngineConfig(model=str(model_dir), context=160, kv_cache_gib=0.05, device="cpu")))
    loop.start()
    return loop


def _answer(client: TestClient, route: str, body: dict) -> tuple[int, str, float]:
    """Status, reply text and the moment it was sent."""
    sent = time.monotonic()
    reply = client.post(route, json=body)
    return reply.status_code, reply.text, sent


@pytest.fixture
def waiting_app(served_model: str) -> Iterator[tuple[TestClient, LocalBackend, Any]]:
    backend, model_dir = _unloaded(served_model)
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny", "alias"], ready_wait_s=300))
    with TestClient(app) as client:
        yield client, backend, model_dir


def test_requests_sent_while_the_engine_loads_wait_for_it(waiting_app: tuple[TestClient, LocalBackend, Any]) -> None:
    client, backend, model_dir = waiting_app
    health = client.get("/health")
    assert health.status_code == 503, health.text
    assert health.json() == {
        "status": "loading",
        "model": "tiny",
        "model_ids": ["tiny", "alias"],
        "warming": True,
        "version": health.json()["version"],
        "message": "Loading model",
    }
    assert client.get("/v1/models").json() == {"object": "list", "data": []}
    refused = client.post("/v1/chat/completions", json={"messages": USER, "n": 2})  # validation does not wait
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        pending = [pool.submit(_answer, client, route, body) for route, body, _ in REQUESTS]
        time.sleep(0.5)
        assert not any(f.done() for f in pending), [f.result() for f in pending if f.done()]
        assert client.get("/health").status_code == 503 and client.get("/v1/models").json()["data"] == []
        loop = _load(model_dir)
        loaded = time.monotonic()
        backend.attach(loop)
        waited = [f.result() for f in pending]
    try:
        assert client.get("/health").status_code == 200 and client.get("/health").json()["status"] == "ok"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        for (route, body, reply_of), (status, text, sent) in zip(REQUESTS, waited):
            assert sent < loaded and status == 200, (route, status, text[:300])
            _, again, _ = _answer(client, route, body)  # the same request once the engine is up
            assert reply_of(text) == reply_of(again) and reply_of(text), (route, text[:300])
    finally:
        loop.shutdown()


def test_a_request_waits_at_most_ready_wait_s(served_model: str) -> None:
    backend, _ = _unloaded(served_model)
    app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"], ready_wait_s=0.4))
    with TestClient(app) as client:
        started = time.monotonic()
        reply = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4})
        elapsed = time.monotonic() - started
        assert reply.status_code == 503 and 0.4 <= elapsed < 10, (reply.text, elapsed)
        error = reply.json()["error"]
        assert error["type"] == "server_error" and error["message"].startswith("the model is not ready"), error
        anthropic = client.post("/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 4})
        assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"


def test_with_keys_health_says_only_loading(served_model: str) -> None:
    backend, model_dir = _unloaded(served_model)
    settings = IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth_settings(["sk-x"], None, False, None))
    with TestClient(build_api(backend, settings)) as client:
        loading = client.get("/health")
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        backend.attach(loop := _load(model_dir))
        try:
            ready = client.get("/health")
            assert ready.status_code == 200 and ready.json() == {"status": "ok"}
        finally:
            loop.shutdown()


class _UnreadyHandle:
    """A Scheduler handle before any replica runs: every broadcast fails as Serve's does."""

    def options(self, **_: Any) -> "_UnreadyHandle":
        return self

    def broadcast(self, *_: Any) -> Any:
        raise RuntimeError("no replicas of deployment Scheduler")


def test_polling_a_loading_graph_says_so_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    import asyncio
    import logging

    from deployments.ingress.backend import GraphBackend

    handle = _UnreadyHandle()
    backend = GraphBackend(handle, handle, handle)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="tensorfold"):
        for _ in range(30):
            assert asyncio.run(backend.replicas()) == []
    lines = [r for r in caplog.records if "Scheduler replica" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.INFO]
