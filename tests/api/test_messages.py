"""Anthropic Messages over the real routes, renderer and engine (in-process tiny-glm), driven by the
official `anthropic` SDK: every body and stream event is validated with the SDK's types, and the reply's
tokens equal the equivalent chat completion's.
"""

import json

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from tests.support.bodies import USER as CAPITAL
from tests.support.local_app import local_backend

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ADD_TOOL = {
    "name": "add",
    "description": "Add two numbers",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS
]
EVENTS = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def http(served_model: str) -> TestClient:
    with local_backend(served_model, window=400) as backend:
        app = build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))
        with TestClient(app) as test_client:
            yield test_client


@pytest.fixture(scope="module")
def client(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=http, max_retries=0)


def _create(client: anthropic.Anthropic, **fields: object) -> Message:
    """Greedy; this SDK sends sampling fields (temperature, top_k, top_p) through extra_body."""
    fields = {"model": "tiny", "max_tokens": 64, "messages": CAPITAL, **fields}
    return client.messages.create(**fields, extra_body={"temperature": 0})  # type: ignore[arg-type]


def _raw_events(http: TestClient, body: dict) -> list[dict]:
    """The stream's events, each checked against the SDK's event types and its `event:` name."""
    reply = http.post("/v1/messages", json={**body, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in reply.text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {payload['type']}"
        if payload["type"] not in ("error", "ping"):  # the SDK skips pings; errors raise
            EVENTS.validate_python(payload)
        events.append(payload)
    return events


def _blocks(message: Message) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for block in message.content:
        if block.type == "thinking":
            out.append(("thinking", block.thinking))
        elif block.type == "text":
            out.append(("text", block.text))
        elif block.type == "tool_use":
            out.append(("tool_use", (block.name, block.input)))
    return out


def test_a_plain_answer_has_thinking_off_by_default(client: anthropic.Anthropic) -> None:
    message = _create(client)
    Message.model_validate(message.model_dump())
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "tiny"
    assert _blocks(message) == [("text", "The capital of France is Paris.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) > 10 and usage.output_tokens > 5
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens_details is not None and usage.output_tokens_details.thinking_tokens == 0


def test_enabled_thinking_returns_plaintext_blocks_with_an_empty_signature(client: anthropic.Anthropic) -> None:
    for thinking in (
        {"type": "enabled", "budget_tokens": 48},
        {"type": "adaptive"},
        {"type": "enabled", "budget_tokens": 48, "display": "omitted"},
    ):
        message = _create(client, thinking=thinking)
        assert _blocks(message) == [
            ("thinking", "The user asks for the capital of France. It is Paris."),
            ("text", "The capital of France is Paris."),
        ]
        assert message.content[0].signature == ""  # type: ignore[union-attr]
        assert message.usage.output_tokens_details.thinking_tokens > 5  # type: ignore[union-attr]


def test_stream_events_build_the_same_message(client: anthropic.Anthropic, http: TestClient) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 64,
        "temperature": 0,
        "messages": CAPITAL,
        "thinking": {"type": "enabled", "budget_tokens": 48},
    }
    whole = _create(client, thinking=body["thinking"])
    events = _raw_events(http, body)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    thinking = "".join(
        e["delta"]["thinking"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
    )
    text = "".join(
        e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
    )
    assert [("thinking", thinking), ("text", text)] == _blocks(whole)
    starts = [e["index"] for e in events if e["type"] == "content_block_start"]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert starts == stops == [0, 1]
    sampling = {"temperature": body.pop("temperature")}
    with client.messages.stream(**body, extra_body=sampling) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.stop_reason == "end_turn"
    assert events[-2]["tensorfold"]["token_sha"] == whole.model_extra["tensorfold"]["token_sha"]


def test_tokens_equal_the_equivalent_chat_completion(client: anthropic.Anthropic, http: TestClient) -> None:
    message = _create(client, thinking={"type": "enabled", "budget_tokens": 48})
    chat = http.post(
        "/v1/chat/completions",
        json={
            "messages": CAPITAL,
            "max_tokens": 64,
            "temperature": 0,
            "thinking_budget": 48,
            "chat_template_kwargs": {"enable_thinking": True},
        },
    ).json()
    assert message.model_extra["tensorfold"]["token_sha"] == chat["tensorfold"]["token_sha"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_tool_use_then_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = _create(client, messages=ask, tools=TOOLS)
    assert _blocks(message) == [("tool_use", ("get_weather", {"city": "Paris"}))]
    assert message.stop_reason == "tool_use" and message.content[0].id.startswith("toolu_")  # type: ignore[union-attr]
    result = {
        "type": "tool_result",
        "tool_use_id": message.content[0].id,  # type: ignore[union-attr]
        "content": [{"type": "text", "text": '{"city": "Paris", "temperature": 18, "condition": "sunny"}'}],
    }
    follow = [*ask, {"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}]
    answer = _create(client, messages=follow, tools=TOOLS)
    assert _blocks(answer) == [("text", "It is sunny in Paris, 18 °C.")]
    assert answer.usage.cache_read_input_tokens > 0  # the earlier turn's prompt resumed from the cache


def test_a_streams_opening_usage_carries_the_same_cache_split_as_its_end(http: TestClient) -> None:
    ask = [{"role": "user", "content": "Name the capital city of each country of Western Europe, one per line. " * 3}]
    body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "messages": ask}
    _raw_events(http, body)  # the prompt's full blocks are now cached
    follow = [*ask, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    events = _raw_events(http, {**body, "messages": follow})
    opening, closing = events[0]["message"]["usage"], events[-2]["usage"]
    assert opening["cache_read_input_tokens"] > 0, (opening, closing)
    assert opening["output_tokens"] == 0
    split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert {key: opening[key] for key in split} == {key: closing[key] for key in split}


def test_streamed_calls_arrive_as_input_json_deltas(http: TestClient) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 64,
        "temperature": 0,
        "tools": TOOLS,
        "messages": [{"role": "user", "content": "What is the weather in Paris and in London?"}],
    }
    events = _raw_events(http, body)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"]) for b in starts] == [("tool_use", "get_weather")] * 2
    args = [json.loads(e["delta"]["partial_json"]) for e in events if e["type"] == "content_block_delta"]
    assert args == [{"city": "Paris"}, {"city": "London"}]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_any_tool_and_none(client: anthropic.Anthropic) -> None:
    forced = _create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "add"})
    assert forced.content and all(b.type == "tool_use" and b.name == "add" for b in forced.content)
    single = _create(
        client, tools=TOOLS, tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True}
    )
    assert [b.type for b in single.content] == ["tool_use"]
    anyone = _create(client, tools=TOOLS, tool_choice={"type": "any"})
    assert anyone.stop_reason == "tool_use"
    hidden = _create(
        client,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    assert all(b.type == "text" for b in hidden.content)


def test_stop_sequences_and_the_token_limit(client: anthropic.Anthropic) -> None:
    stopped = _create(client, stop_sequences=["Paris"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert _blocks(stopped) == [("text", "The capital of France is ")]
    cut = _create(client, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_output_config_json_schema_constrains_the_answer(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    output = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    message = _create(client, max_tokens=40, output_config=output)
    value = json.loads(message.content[0].text)  # type: ignore[union-attr]
    assert set(value) == {"city"} and len(value["city"]) <= 12


def test_count_tokens_renders_the_same_prompt(client: anthropic.Anthropic, http: TestClient) -> None:
    system = [{"type": "text", "text": "You are a pirate.", "cache_control": {"type": "ephemeral"}}]
    hello = [{"role": "user", "content": "Hello"}]
    counted = client.messages.count_tokens(model="tiny", system=system, messages=hello, tools=TOOLS)
    message = _create(client, system=system, messages=hello, tools=TOOLS)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    ids = http.post(
        "/tokenize",
        json={
            "messages": [{"role": "system", "content": "You are a pirate."}, *hello],
            "tools": CHAT_TOOLS,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert counted.input_tokens == ids.json()["count"]


def test_a_claude_code_shaped_request_succeeds(http: TestClient) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 120,
        "stream": True,
        "temperature": 1,
        "metadata": {"user_id": "user_abc"},
        "system": [
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Be brief."},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "What is the weather in Paris?", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}, ADD_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 31},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    }
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    events = _raw_events(http, body)
    assert events[-1]["type"] == "message_stop"
    assert events[-2]["usage"]["output_tokens"] > 0


def test_a_mid_conversation_system_message_stays_in_place(client: anthropic.Anthropic, http: TestClient) -> None:
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you!"},
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hello"},
    ]
    counted = http.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": messages}).json()
    chat = [*messages[:2], {"role": "system", "content": "Answer in one word."}, messages[3]]
    ids = http.post("/tokenize", json={"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert counted["input_tokens"] == ids["count"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 10_000}, "This server's maximum context length is 400 tokens"),  # a context refusal
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ]
            },
            "vision",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "document", "source": {"type": "file", "file_id": "file_1"}}]}
                ]
            },
            "documents",
        ),
        ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]}, "redacted"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server-side"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "keep-all"),
        ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "less than max_tokens"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER_TOOL]}, "tool_choice.name"),
        ({"temperature": -1}, "temperature"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"stop_sequences": "x"}, "stop_sequences"),
    ],
)
def test_refusals_use_anthropics_envelope(http: TestClient, fields: dict, words: str) -> None:
    body = {"model": "tiny", "max_tokens": 64, "messages": CAPITAL, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        reply = http.post("/v1/messages", json={**body, "stream": stream})
        assert reply.status_code == 400, reply.text
        payload = reply.json()
        assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
        assert words in payload["error"]["message"]


def test_sdk_errors_and_unknown_paths(client: anthropic.Anthropic, http: TestClient) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        _create(client, messages=[])
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    missing = http.post("/v1/messages/batches", json={})
    assert missing.status_code in (404, 405) and missing.json()["type"] == "error"
    broken = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
