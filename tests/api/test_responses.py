"""POST /v1/responses, GET and DELETE /v1/responses/{id} over the real renderer and engine (in-process).

tiny-glm writes its scripted replies (serve_app/fixtures/tiny_glm/corpus.py), so each response is checked
for exact text, against the SDK's types, against its streamed form, and against the equivalent chat
completion (same token_sha at temperature 0). The official `openai` SDK drives the routes through the
TestClient.
"""

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.messages.requests import EngineRequest
from deployments.messages.status import UpstreamItem
from serve_app.fixtures.tiny_glm.corpus import PARIS_WEATHER, TOOLS
from serve_app.local_backend import LocalBackend
from tests.support.local_app import local_backend

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
EVENTS = TypeAdapter(ResponseStreamEvent)


SETTINGS = IngressSettings(served_name="tiny", model_ids=["tiny"])


@pytest.fixture(scope="module")
def backend(served_model: str) -> Iterator[LocalBackend]:
    with local_backend(served_model, window=640) as local:
        yield local


@pytest.fixture(scope="module")
def client(backend: LocalBackend) -> Iterator[TestClient]:
    with TestClient(build_api(backend, SETTINGS)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def sdk(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


def _create(client: TestClient, **fields: object) -> dict:
    reply = client.post("/v1/responses", json={"temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    Response.model_validate(body)
    return body


def _texts(body: dict) -> tuple[str | None, str]:
    """(reasoning, output text) of a Response body."""
    reasoning = None
    text = ""
    for item in body["output"]:
        if item["type"] == "reasoning":
            reasoning = "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            text += "".join(part["text"] for part in item["content"])
    return reasoning, text


def _stream(sdk: openai.OpenAI, **fields: object) -> list:
    events = list(sdk.responses.create(model="tiny", stream=True, temperature=0, **fields))
    for event in events:
        EVENTS.validate_python(event.to_dict())  # strict: every field the SDK's type requires
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _chat(client: TestClient, messages: list[dict], **fields: object) -> dict:
    reply = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_thinking_reply_has_a_reasoning_item_and_a_message(sdk: openai.OpenAI, client: TestClient) -> None:
    response = sdk.responses.create(model="tiny", input="What is the capital of France?", temperature=0)
    assert response.status == "completed" and response.object == "response" and response.id.startswith("resp_")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content[0].text == "The user asks for the capital of France. It is Paris."
    assert message.type == "message" and response.output_text == "The capital of France is Paris."
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    raw = _create(client, input="What is the capital of France?")
    chat = _chat(client, [{"role": "user", "content": "What is the capital of France?"}])
    assert raw["tensorfold"]["token_sha"] == chat["tensorfold"]["token_sha"]  # the same run as chat
    assert raw["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_the_stream_is_typed_and_its_deltas_join_to_the_whole_reply(sdk: openai.OpenAI, client: TestClient) -> None:
    whole = _create(client, input="What is the capital of France?")
    events = _stream(sdk, input="What is the capital of France?")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == _texts(whole)
    final = events[-1].response
    assert _texts(final.to_dict()) == _texts(whole)
    assert final.usage.to_dict() == whole["usage"] and final.id == events[0].response.id
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.to_dict() for e in done] == [item.to_dict() for item in final.output]
    with sdk.responses.stream(model="tiny", input="What is the capital of France?", temperature=0) as stream:
        assert stream.get_final_response().output_text == "The capital of France is Paris."


def test_the_token_limit_makes_it_incomplete(sdk: openai.OpenAI, client: TestClient) -> None:
    body = _create(client, input="What is the capital of France?", max_output_tokens=4)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 4 == body["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert body["output"][-1]["status"] == "incomplete"
    events = _stream(sdk, input="What is the capital of France?", max_output_tokens=4)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_a_function_call_then_its_output_continues_from_the_prompt_cache(
    sdk: openai.OpenAI, client: TestClient
) -> None:
    first = sdk.responses.create(
        model="tiny", input="What is the weather in Paris?", tools=RESPONSE_TOOLS, temperature=0, extra_body=NO_THINK
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and first.status == "completed"
    second = sdk.responses.create(
        model="tiny",
        previous_response_id=first.id,
        tools=RESPONSE_TOOLS,
        temperature=0,
        extra_body=NO_THINK,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": PARIS_WEATHER}],
    )
    assert second.output_text == "It is sunny in Paris, 18 °C." and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first prompt's blocks were reused
    # The same conversation sent as items (no stored state) renders the same prompt and reply.
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call.to_dict(),
        {"type": "function_call_output", "call_id": call.call_id, "output": PARIS_WEATHER},
    ]
    again = _create(client, input=items, tools=RESPONSE_TOOLS, **NO_THINK)
    assert again["tensorfold"]["token_sha"] == second.to_dict()["tensorfold"]["token_sha"]


def test_streamed_function_calls(sdk: openai.OpenAI) -> None:
    events = _stream(
        sdk, input="What is the weather in Paris and in London?", tools=RESPONSE_TOOLS, extra_body=NO_THINK
    )
    kinds = [e.type for e in events if e.type.startswith("response.function_call") or "item" in e.type]
    one = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert kinds == one + one
    calls = [e.item for e in events if e.type == "response.output_item.done"]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "London"]
    assert [c.output_index for c in events if c.type == "response.output_item.done"] == [0, 1]


def test_reasoning_items_return_as_the_assistant_turns_reasoning(client: TestClient) -> None:
    tokyo_call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Tokyo"}'}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is the weather like in Tokyo?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "I should call get_weather for Tokyo."}],
        },
        tokyo_call,
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": '{"city": "Tokyo", "temperature": 12, "condition": "rainy"}',
        },
    ]
    body = _create(client, input=items, tools=RESPONSE_TOOLS)
    assert _texts(body) == ("The tool says it is rainy and 12 degrees.", "It is rainy in Tokyo, 12 °C.")
    chat_tools = [{"type": "function", "function": tool["function"]} for tool in TOOLS]
    messages = [
        {"role": "user", "content": "What is the weather like in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call get_weather for Tokyo.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": items[3]["output"]},
    ]
    chat = _chat(client, messages, tools=chat_tools)
    assert body["tensorfold"]["token_sha"] == chat["tensorfold"]["token_sha"]


def test_instructions_are_a_system_message_not_carried_to_the_next_turn(client: TestClient) -> None:
    first = _create(client, input="Hello", instructions="You are a pirate.", **NO_THINK)
    assert _texts(first)[1] == "Arr! Ahoy, matey!" and first["instructions"] == "You are a pirate."
    second = _create(client, input="Hello", previous_response_id=first["id"], **NO_THINK)
    assert second["instructions"] is None
    messages = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Arr! Ahoy, matey!"},
        {"role": "user", "content": "Hello"},
    ]
    chat = _chat(client, messages, **NO_THINK)
    assert second["tensorfold"]["token_sha"] == chat["tensorfold"]["token_sha"]
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_text_format_json_schema_goes_through_the_grammar(client: TestClient) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    body = _create(
        client,
        input="Give me a JSON object for Alice, aged 30.",
        text={"format": fmt},
        max_output_tokens=60,
        **NO_THINK,
    )
    value = json.loads(_texts(body)[1])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert body["text"]["format"]["name"] == "person"


def test_forced_and_allowed_tool_choices(client: TestClient) -> None:
    named = _create(
        client,
        input="What is the weather in Paris?",
        tools=RESPONSE_TOOLS,
        max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"},
        **NO_THINK,
    )
    assert [item["name"] for item in named["output"]] == ["get_weather"]
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "add"}]}
    only_add = _create(
        client,
        input="What is the weather in Paris?",
        tools=RESPONSE_TOOLS,
        tool_choice=allowed,
        max_output_tokens=40,
        parallel_tool_calls=False,
        **NO_THINK,
    )
    assert [item["name"] for item in only_add["output"] if item["type"] == "function_call"] == ["add"]
    assert only_add["tool_choice"] == allowed and only_add["parallel_tool_calls"] is False


def test_store_retrieve_delete(sdk: openai.OpenAI, client: TestClient) -> None:
    created = _create(client, input="Hello", metadata={"run": "1"}, **NO_THINK)
    assert created["store"] is True and created["metadata"] == {"run": "1"}
    assert sdk.responses.retrieve(created["id"]).to_dict() == Response.model_validate(created).to_dict()
    assert client.get(f"/v1/responses/{created['id']}").json() == created
    assert client.delete(f"/v1/responses/{created['id']}").json() == {
        "id": created["id"],
        "object": "response.deleted",
        "deleted": True,
    }
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created["id"])
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(created["id"])
    missing = client.get("/v1/responses/resp_missing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    unstored = _create(client, input="Hello", store=False, **NO_THINK)
    assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    streamed = _stream(sdk, input="Hello", extra_body=NO_THINK)
    final = streamed[-1].response.to_dict()
    assert client.get(f"/v1/responses/{final['id']}").json() == json.loads(json.dumps(final))


TOO_MANY = {f"k{i}": "v" for i in range(17)}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0]"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0]"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": True}, "logprobs"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        (
            {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "abc"}]},
            "input[0].encrypted_content",
        ),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"metadata": TOO_MANY}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"include": ["file_search_call.results", "nonsense"]}, "include"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": RESPONSE_TOOLS}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format.schema"),
        ({"text": "json"}, "text"),
        ({"temperature": -1}, "temperature"),
        ({"input": []}, "input"),
        ({"input": "word " * 2000}, "input"),  # over the window: chat's `messages` refusal, renamed
        ({"input": "Hello", "max_output_tokens": 10_000}, "input"),  # a context refusal names the input too
        ({"input": None}, "input"),
    ],
)
def test_refusals_name_the_responses_field(client: TestClient, fields: dict, param: str) -> None:
    reply = client.post("/v1/responses", json={"input": "Hello", **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_accepted_and_ignored_fields(client: TestClient) -> None:
    body = _create(
        client,
        input="Hello",
        include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        reasoning={"summary": "auto"},
        truncation="disabled",
        n=3,
        user="u",
        draft=True,
        service_tier="auto",
        **NO_THINK,
    )
    assert _texts(body)[1] == "Hello! I am tiny-glm, a small model served by TensorFold."
    assert body["reasoning"] == {"effort": None, "summary": None}
    off = _create(client, input="What is the capital of France?", reasoning={"effort": "none"})
    assert _texts(off) == (None, "The capital of France is Paris.")  # effort none turns thinking off


def test_the_sdk_sees_a_400_with_its_param(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model="tiny", input="Hello", tools=[{"type": "web_search_preview"}])
    assert caught.value.param == "tools[0]"


class _DyingStream:
    """The real engine's stream, cut by a replica failure after its first items (fault injection)."""

    def __init__(self, inner: Any, items_before_failure: int) -> None:
        self.inner, self.left = inner, items_before_failure

    def __aiter__(self) -> AsyncIterator[UpstreamItem]:
        return self._run()

    async def _run(self) -> AsyncIterator[UpstreamItem]:
        async for item in self.inner:
            if self.left == 0:
                raise RuntimeError("replica died")
            self.left -= 1
            yield item

    async def close(self) -> None:
        await self.inner.close()


class _DyingBackend:
    def __init__(self, backend: LocalBackend) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def stream(self, request: EngineRequest) -> _DyingStream:
        return _DyingStream(self.backend.stream(request), items_before_failure=6)


def test_a_failure_after_the_stream_opened_is_response_failed(backend: LocalBackend) -> None:
    with TestClient(build_api(_DyingBackend(backend), SETTINGS)) as dying:  # type: ignore[arg-type]
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=dying)
        events = _stream(sdk, input="What is the capital of France?", store=True)
        last = events[-1]
        assert last.type == "response.failed" and last.response.status == "failed"
        assert last.response.error.code == "server_error" and "replica died" in last.response.error.message
        assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
        assert dying.get(f"/v1/responses/{last.response.id}").status_code == 404  # a failed reply is not kept
        whole = dying.post("/v1/responses", json={"input": "What is the capital of France?"})
        assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
