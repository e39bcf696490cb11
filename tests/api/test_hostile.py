"""Hostile input on every POST route, in-process over the real routes, renderer and engine (no Ray).

Each route answers malformed JSON, wrong types, invalid UTF-8, unknown enum values, oversized bodies,
absurd numbers and deep nesting with a quick 4xx in its own format; afterwards the engine holds no
request and a reference reply is unchanged. The fuzzing run is tests/api/test_hostile_fuzz.py.
"""

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
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


# ---- what fuzzing found: 18,490 generated requests and 100 hostile bodies --------------------------------

HUGE_INTEGER = b"1" * 4301  # one digit past what Python reads from text: json.loads raised ValueError (a 500)


def test_an_integer_python_cannot_read_is_one_logged_400_on_every_route(
    client: TestClient, post_routes: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tensorfold")
    body = b'{"messages": [{"role": "user", "content": "hi"}], "prompt": "x", "max_tokens": ' + HUGE_INTEGER + b"}"
    for path in post_routes:
        reply, elapsed = raw_post(client, path, body)
        assert_refused(reply, elapsed, path, (400,))
        message = reply.json()["error"]["message"]
        assert "more than 4300 digits" in message, (path, message)
    access = [r.getMessage() for r in caplog.records if r.name == "tensorfold.access"]
    assert len(access) == len(post_routes) and all(" status=400 " in line for line in access), access
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]  # no traceback


def test_a_fact_id_of_thousands_of_digits_is_a_400(backend: LocalBackend) -> None:
    settings = IngressSettings(served_name="tiny", model_ids=["tiny"], slide=True)  # the id is read first
    with TestClient(build_api(backend, settings), raise_server_exceptions=False) as slide:
        for raw in ("1" * 4301, "1" * 19, "0", "x1"):
            reply = slide.delete(f"/v1/slide/fact/{raw}")
            error = reply.json()["error"]
            assert reply.status_code == 400 and (error["param"], error["code"]) == ("id", "invalid_fact_id"), raw[:20]


def test_a_content_length_of_thousands_of_digits_is_over_the_limit(client: TestClient) -> None:
    headers = {**AUTH, "content-type": "application/json", "content-length": "9" * 4301}
    assert client.post("/v1/completions", content=b"{}", headers=headers).status_code == 413


def test_logged_client_text_cannot_forge_lines_or_pass_terminal_escapes(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tensorfold")
    client.get("/v1/models%0Aforged%20line%0D%1b[31m", headers=AUTH)
    client.get("/v1/models%0Aunkeyed")  # the 401 line
    client.post("/v1/chat/completions", json={"model": "x\nrefused fake", "messages": USER}, headers=AUTH)
    lines = [r.getMessage() for r in caplog.records if r.name in ("tensorfold.access", "tensorfold.requests")]
    assert any("/v1/models\\x0aforged line\\x0d\\x1b[31m status=404" in line for line in lines), lines
    assert any("/v1/models\\x0aunkeyed status=401" in line for line in lines), lines
    assert any(line.startswith("refused chatcmpl-") and "x\\x0arefused fake" in line for line in lines), lines
    assert not [line for line in lines if "\n" in line or "\r" in line or "\x1b" in line]


def _spec(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json", headers=AUTH).json()


def test_the_document_asks_no_key_of_the_open_routes(client: TestClient) -> None:
    spec = _spec(client)
    assert spec["security"] == [{"bearer": []}, {"apiKey": []}]
    for path in ("/", "/health"):
        assert spec["paths"][path]["get"]["security"] == []
        assert client.get(path).status_code == 200  # no key sent
    assert "security" not in spec["paths"]["/v1/models"]["get"]  # the document's default: a key


def test_the_document_lists_the_statuses_a_route_answers(client: TestClient) -> None:
    spec = _spec(client)
    for path, operations in spec["paths"].items():
        assert all("422" not in op["responses"] for op in operations.values()), path  # bodies are read by hand
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    stored = spec["paths"]["/v1/responses/{response_id}"]
    for method in ("get", "delete"):
        assert "404" in stored[method]["responses"]
        reply = client.request(method.upper(), "/v1/responses/resp_missing", headers=AUTH)
        assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error"


def test_the_document_describes_each_slide_event(backend: LocalBackend) -> None:
    from deployments.ingress.slide.framing import NamedEvent, sse_named

    settings = IngressSettings(served_name="tiny", model_ids=["tiny"], slide=True)
    spec = TestClient(build_api(backend, settings)).get("/openapi.json").json()
    for path, method, kind in (
        ("/v1/slide/learn", "post", "slide.learn"),
        ("/v1/slide/fact/{id}", "delete", "slide.delete"),
    ):
        content = spec["paths"][path][method]["responses"]["200"]["content"]
        event = content["text/event-stream"]["schema"]
        names = event["properties"]["event"]["enum"]
        data = event["properties"]["data"]
        assert data["contentMediaType"] == "application/json" and data["contentSchema"]["required"] == ["type"]
        assert "fact" in names and "error" in names and data["contentSchema"]["properties"]["type"]["enum"] == names
        assert content["application/json"]["schema"]["properties"]["object"] == {"const": kind}
        sent = sse_named(NamedEvent("fact", {"id": 1})).decode()  # what a stream writes, read as the document says
        name, payload = (line.split(": ", 1)[1] for line in sent.strip().split("\n"))
        assert name in names and json.loads(payload)["type"] == name


def test_the_document_marks_what_a_route_requires(client: TestClient) -> None:
    schemas = _spec(client)["components"]["schemas"]
    assert "input" in schemas["ResponsesRequest"]["required"]
    assert schemas["MessagesRequest"]["properties"]["messages"]["minItems"] == 1
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    questions = schemas["DecisionRequest"]["properties"]["questions"]
    assert "questions" in schemas["DecisionRequest"]["required"] and questions["minItems"] == 1
    refused = {
        "/v1/responses": ({"model": "tiny"}, "input"),
        "/v1/messages": ({"messages": [], "max_tokens": 4}, "messages"),
        "/v1/decisions": ({"input": "x", "questions": []}, "questions"),
    }
    for path, (body, field) in refused.items():
        reply, elapsed = raw_post(client, path, json.dumps(body).encode())
        assert_refused(reply, elapsed, path, (400,))
        assert reply.json()["error"]["message"].startswith(field), (path, reply.json())


def test_types_the_document_refuses_the_route_refuses(client: TestClient) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):  # a completions body with messages is chat
        reply = client.post(path, json={"messages": USER, "echo": 0}, headers=AUTH)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo", (path, reply.text)
    kwargs = _spec(client)["components"]["schemas"]["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]
    assert {"type": "null"} in kwargs["anyOf"]  # null keeps the defaults, as the document now says
    body = {"messages": USER, "max_tokens": 2, "chat_template_kwargs": None}
    assert client.post("/v1/chat/completions", json=body, headers=AUTH).status_code == 200


def test_the_document_shows_every_stop_form_a_route_takes_and_none_it_refuses(client: TestClient) -> None:
    """stop: a string, a list of strings, or null (each nonempty), on every route that takes it."""
    schemas = _spec(client)["components"]["schemas"]
    routes = {
        "/v1/chat/completions": ("ChatCompletionRequest", {"messages": USER}),
        "/v1/completions": ("CompletionRequest", {"prompt": "Hi"}),
        "/v1/responses": ("ResponsesRequest", {"input": "Hi"}),
    }
    for path, (name, body) in routes.items():
        stop = schemas[name]["properties"]["stop"]
        for value, taken in (("x", True), (["x", "y"], True), (None, True), ("", False), ([""], False), (3, False)):
            documented = jsonschema.Draft202012Validator(stop).is_valid(value)
            reply = client.post(path, json={**body, "max_tokens": 2, "stop": value}, headers=AUTH)
            assert documented == taken == (reply.status_code == 200), (path, value, reply.text)


def test_refusals_inside_a_list_name_the_part(client: TestClient) -> None:
    tools = [
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b"}},
        {"type": "function", "function": {"name": "c", "parameters": {"type": "array"}}},
    ]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}
    namespaces = [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": f}]} for f in "ab"]
    for path, body, param in (
        ("/v1/chat/completions", {"messages": USER, "tools": tools}, "tools[2].function.parameters"),
        ("/v1/chat/completions", {"messages": [*USER, image]}, "messages[1].content[0].image_url.url"),
        (
            "/v1/responses",
            {"input": "x", "tools": [{"type": "function", "name": "a"}, {"type": "web_search"}]},
            "tools[1]",
        ),
        ("/v1/responses", {"input": "x", "tools": namespaces}, "tools[1].name"),
    ):
        reply = client.post(path, json=body, headers=AUTH)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, (path, reply.text)
    blocks = {"messages": [{"role": "user", "content": [{"type": "document"}]}], "max_tokens": 4}
    reply = client.post("/v1/messages", json=blocks, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["message"].startswith("messages[0].content[0]: ")


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
