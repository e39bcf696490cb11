"""Responses tools beyond plain functions: namespace tools, and built-in tools refused or dropped.

tiny-glm writes its scripted replies, so a namespace's functions are checked to render the very prompt the
same functions sent flat render (same token_sha), to come back as calls carrying their namespace, and to
round trip through `function_call_output`. Codex's own request bodies (captured from Codex 0.171 and trimmed:
tests/api/codex/) are sent as Codex sends them, with and without `drop_builtin_tools`.
"""

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.fixtures.tiny_glm.corpus import PARIS_WEATHER, TOOLS
from tests.support.local_app import local_backend

CODEX = Path(__file__).parent / "codex"
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
FLAT = [{"type": "function", **tool["function"]} for tool in TOOLS]
GROUPED = [{"type": "namespace", "name": "weather", "description": "Weather tools.", "tools": FLAT}]
ASK = "What is the weather in Paris?"
SETTINGS = IngressSettings(served_name="tiny", model_ids=["tiny"])


@pytest.fixture(scope="module")
def clients(served_model: str) -> Iterator[tuple[TestClient, TestClient]]:
    """Two Ingress apps over one engine: the default settings, and `drop_builtin_tools`."""
    dropping = SETTINGS.model_copy(update={"drop_builtin_tools": True})
    with local_backend(served_model, window=4096) as backend:
        with TestClient(build_api(backend, SETTINGS)) as plain, TestClient(build_api(backend, dropping)) as drop:
            yield plain, drop


@pytest.fixture(scope="module")
def client(clients: tuple[TestClient, TestClient]) -> TestClient:
    return clients[0]


def _create(client: TestClient, **fields: object) -> dict:
    reply = client.post("/v1/responses", json={"model": "tiny", "temperature": 0, **NO_THINK, **fields})
    assert reply.status_code == 200, reply.text
    Response.model_validate(reply.json())
    return reply.json()


def test_a_namespace_offers_its_functions_and_its_calls_carry_it(client: TestClient) -> None:
    flat, grouped = _create(client, input=ASK, tools=FLAT), _create(client, input=ASK, tools=GROUPED)
    assert grouped["tensorfold"]["token_sha"] == flat["tensorfold"]["token_sha"]  # the template saw the same tools
    (call,) = grouped["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["namespace"] == "weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert "namespace" not in flat["output"][0]
    assert grouped["tools"] == GROUPED  # echoed as sent


def test_a_namespaced_call_round_trips_through_its_output(client: TestClient) -> None:
    first = _create(client, input=ASK, tools=GROUPED)
    (call,) = first["output"]
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": PARIS_WEATHER}
    stored = _create(client, previous_response_id=first["id"], input=[answer], tools=GROUPED)
    assert stored["output"][0]["content"][0]["text"] == "It is sunny in Paris, 18 °C."
    sent_back = _create(client, input=[{"role": "user", "content": ASK}, call, answer], tools=GROUPED)
    flat_call = {key: value for key, value in call.items() if key != "namespace"}
    flat = _create(client, input=[{"role": "user", "content": ASK}, flat_call, answer], tools=FLAT)
    shas = {body["tensorfold"]["token_sha"] for body in (stored, sent_back, flat)}
    assert len(shas) == 1  # the namespaced call renders as the same call in every history


def test_streamed_namespaced_calls(client: TestClient) -> None:
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    events = list(
        sdk.responses.create(
            model="tiny",
            input="What is the weather in Paris and in London?",
            tools=GROUPED,  # type: ignore[arg-type]
            stream=True,
            temperature=0,
            extra_body=NO_THINK,
        )
    )
    items = [
        e.to_dict()["item"] for e in events if e.type in ("response.output_item.added", "response.output_item.done")
    ]
    assert len(items) == 4 and all(item["namespace"] == "weather" for item in items)
    assert [json.loads(item["arguments"])["city"] for item in items[1::2]] == ["Paris", "London"]
    final = events[-1].to_dict()["response"]["output"]
    assert [item["namespace"] for item in final] == ["weather", "weather"]


@pytest.mark.parametrize(
    ("tools", "param", "words"),
    [
        ([{"type": "namespace", "tools": FLAT}], "tools[0].name", "tools[0].name: a namespace tool needs a name"),
        ([{"type": "namespace", "name": "n", "tools": []}], "tools[0].tools", "tools[0].tools: a namespace tool needs"),
        (
            [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}],
            "tools[0].tools[0]",
            "got 'web_search'",
        ),
        (
            [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "a b"}]}],
            "tools[0].tools[0].name",
            "tools[0].tools[0].name: 'a b' does not match",
        ),
        (FLAT + GROUPED, "tools[2].tools[0].name", "is already the name of tools[0]; tool names must be unique"),
        (
            GROUPED + [{"type": "namespace", "name": "weather", "tools": FLAT}],
            "tools[1].name",
            "tools[1].name: 'weather' is already the name of tools[0]; namespace names must be unique",
        ),
        ([{"type": "custom", "name": "apply_patch"}], "tools[0]", "tools of type 'custom' are not supported"),
    ],
)
def test_bad_namespaces_are_refused_naming_the_path(
    clients: tuple[TestClient, TestClient], tools: list, param: str, words: str
) -> None:
    for client in clients:  # dropping built-in tools changes none of these refusals
        reply = client.post("/v1/responses", json={"model": "tiny", "input": ASK, "tools": tools})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_a_namespaced_function_call_item_needs_a_string_namespace(client: TestClient) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "namespace": 3}
    reply = client.post("/v1/responses", json={"input": [call], "tools": GROUPED})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "input[0].namespace: must be a string"


def _codex(name: str) -> dict:
    body = json.loads((CODEX / name).read_text(encoding="utf-8"))
    body.update(stream=False, max_output_tokens=8, temperature=0)  # a short, whole reply to check
    return body


def test_codex_defaults_are_refused_by_default_naming_the_built_in(client: TestClient) -> None:
    reply = client.post("/v1/responses", json=_codex("first_turn.json"))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "tools[8]" and error["message"].startswith("tools[8]: built-in tools ('web_search')")
    assert "--drop-builtin-tools" in error["message"]


def test_codex_defaults_run_with_built_in_tools_dropped(
    clients: tuple[TestClient, TestClient], caplog: pytest.LogCaptureFixture
) -> None:
    _, drop = clients
    with caplog.at_level(logging.INFO, logger="tensorfold.ingress"):
        reply = drop.post("/v1/responses", json=_codex("first_turn.json"))
    assert reply.status_code == 200, reply.text
    assert "dropped built-in tools the server does not run: web_search" in caplog.messages
    assert reply.json()["status"] in ("completed", "incomplete") and reply.json()["usage"]["input_tokens"] > 0


def test_codex_sends_a_namespaced_call_back_and_it_renders(clients: tuple[TestClient, TestClient]) -> None:
    """Codex's second turn: the namespaced call the server returned, then Codex's output for it."""
    _, drop = clients
    body = _codex("second_turn.json")
    call, output = body["input"][-2:]
    assert call["namespace"] == "multi_agent_v1" and output["call_id"] == call["call_id"]
    reply = drop.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    # The same history with the call sent flat renders the same prompt: the namespace names where it belongs.
    flat = dict(body, input=body["input"][:-2] + [{k: v for k, v in call.items() if k != "namespace"}, output])
    again = drop.post("/v1/responses", json=flat)
    assert again.json()["usage"]["input_tokens"] == reply.json()["usage"]["input_tokens"]
    assert again.json()["tensorfold"]["token_sha"] == reply.json()["tensorfold"]["token_sha"]
