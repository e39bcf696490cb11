"""Hostile input on every POST route, in-process over the real routes, renderer and engine (no Ray).

Each route answers malformed JSON, wrong types, invalid UTF-8, unknown enum values, oversized bodies,
absurd numbers and deep nesting with a quick 4xx in its own format; afterwards the engine holds no
request and a reference reply is unchanged. The fuzzing run is tests/api/test_hostile_fuzz.py.
"""

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.http.keys import auth_settings
from deployments.ingress.http.limits import DEFAULT_MAX_BODY_BYTES, is_anthropic
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER
from tests.support.local_app import local_backend

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUICK_S = 3.0  # generous for a loaded 2-core machine; the real figures are tens of milliseconds
REFERENCE = {"messages": USER, "max_tokens": 8, "temperature": 0.8, "seed": 5}


@pytest.fixture(scope="module")
def backend(served_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    # The disk store on, so the imprint routes validate their bodies too (off, they answer 404 to anything).
    with local_backend(served_model, learn_dir=str(tmp_path_factory.mktemp("learned"))) as value:
        yield value


@pytest.fixture(scope="module")
def client(backend: LocalBackend) -> Iterator[TestClient]:
    auth = auth_settings([KEY], None, False, None)
    settings = IngressSettings(served_name="tiny", model_ids=["tiny"], auth=auth, learn_conversations=True)
    app = build_api(backend, settings)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def post_routes(client: TestClient) -> list[str]:
    paths = client.app.openapi()["paths"]
    return [path for path, ops in paths.items() if "post" in ops]


@pytest.fixture(scope="module")
def reference_reply(client: TestClient) -> dict[str, Any]:
    return client.post("/v1/chat/completions", json=REFERENCE, headers=AUTH).json()


def raw_post(client: TestClient, path: str, content: bytes) -> Any:
    started = time.monotonic()
    reply = client.post(path, content=content, headers={**AUTH, "content-type": "application/json"})
    return reply, time.monotonic() - started


def assert_refused(reply: Any, elapsed: float, path: str, statuses: tuple[int, ...] = (400, 413, 422)) -> None:
    assert reply.status_code in statuses, (path, reply.status_code, reply.text[:300])
    assert elapsed < QUICK_S, (path, elapsed)
    body = reply.json()
    if is_anthropic(path):
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


HOSTILE_BODIES = {
    "not json": b'{"messages": [',
    "json array": b"[1, 2, 3]",
    "json null": b"null",
    "empty": b"",
    "invalid utf-8": b'{"prompt": "\xff\xfe\xfa", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
    "lone surrogate": b'{"prompt": "\\ud800", "tokens": [1], "messages": [{"role": "user", "content": "a\\udc00"}]}',
    "NaN": b'{"prompt": "x", "tokens": [NaN], "messages": [], "max_tokens": NaN, "temperature": NaN}',
    "deep nesting": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "nested just over": json.dumps({"messages": USER, "tools": json.loads("[" * 70 + "]" * 70)}).encode(),
}
HOSTILE_FIELDS: dict[str, dict[str, Any]] = {
    "wrong types": {"messages": "hello", "prompt": {"a": 1}, "tokens": "x", "max_tokens": "many"},
    "unknown role": {"messages": [{"role": "wizard", "content": "x"}], "prompt": 5, "tokens": [[1]]},
    "unknown effort": {
        "messages": USER,
        "prompt": "x",
        "tokens": [1.5],
        "reasoning_effort": "ludicrous",
        "priority": "urgent",
        "tool_choice": "sometimes",
    },
    "max_tokens 10^12": {"messages": USER, "prompt": "x", "tokens": [10**12], "max_tokens": 10**12},
    "numbers past int64": {"messages": USER, "prompt": [2**70], "tokens": [2**70], "seed": 2**200, "n": 10**9},
    "negative everything": {
        "messages": USER,
        "prompt": "x",
        "tokens": [-1],
        "max_tokens": -5,
        "top_k": -9,
        "temperature": -1,
    },
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_bodies_get_a_quick_4xx_on_every_route(
    client: TestClient, post_routes: list[str], name: str, reference_reply: dict[str, Any]
) -> None:
    for path in post_routes:
        reply, elapsed = raw_post(client, path, HOSTILE_BODIES[name])
        assert_refused(reply, elapsed, path)


@pytest.mark.parametrize("name", list(HOSTILE_FIELDS))
def test_hostile_fields_get_a_quick_4xx_on_every_route(client: TestClient, post_routes: list[str], name: str) -> None:
    for path in post_routes:
        reply, elapsed = raw_post(client, path, json.dumps(HOSTILE_FIELDS[name]).encode())
        assert_refused(reply, elapsed, path)


def test_oversized_bodies_get_413_before_they_are_read(client: TestClient, post_routes: list[str]) -> None:
    twenty_mb = json.dumps({"messages": [{"role": "user", "content": "a" * (20 << 20)}], "prompt": "a"}).encode()
    assert len(twenty_mb) > DEFAULT_MAX_BODY_BYTES
    for path in post_routes:
        reply, elapsed = raw_post(client, path, twenty_mb)
        assert_refused(reply, elapsed, path, (413,))
        error = reply.json()["error"]
        assert (error["type"] if is_anthropic(path) else error["code"]) == "request_too_large"


def test_a_chunked_body_is_counted_as_it_arrives(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1 << 20)
        yield b'"}'

    reply = client.post("/v1/completions", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_a_million_messages_and_a_window_full_of_them(client: TestClient) -> None:
    million = b'{"messages": [' + b", ".join([b'{"role": "user", "content": "a"}'] * 10**6) + b"]}"
    reply, elapsed = raw_post(client, "/v1/chat/completions", million)
    assert_refused(reply, elapsed, "/v1/chat/completions", (413,))
    many = json.dumps({"messages": [{"role": "user", "content": "a"}] * 20_000}).encode()  # under the size limit
    for path in ("/v1/chat/completions", "/tokenize"):
        reply, elapsed = raw_post(client, path, many)
        assert_refused(reply, elapsed, path)
        assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_bad_content_length_and_auth_come_first(client: TestClient) -> None:
    reply = client.post("/v1/completions", content=b"{}", headers={**AUTH, "content-length": "lots"})
    assert reply.status_code == 400
    big = b"x" * (DEFAULT_MAX_BODY_BYTES + 1)
    assert client.post("/v1/completions", content=big).status_code == 401  # no key: refused before reading


def test_the_server_stays_healthy_and_replies_the_same(
    client: TestClient, backend: LocalBackend, reference_reply: dict[str, Any]
) -> None:
    # Runs after the hostile tests in this module (pytest keeps file order); the reference ran before them.
    assert client.get("/health").json() == {"status": "ok"}
    (status,) = asyncio.run(backend.replicas())  # the counters /health shows when no keys are configured
    assert status.running == 0 and status.waiting == 0
    again = client.post("/v1/chat/completions", json=REFERENCE, headers=AUTH).json()
    assert again["choices"] == reference_reply["choices"]
    assert again["tensorfold"]["token_sha"] == reference_reply["tensorfold"]["token_sha"]
