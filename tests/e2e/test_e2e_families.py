"""Anthropic Messages, OpenAI Responses and Decisions through the real graph on Ray Serve (configs/glm.yaml),
each driven by its official SDK (or plain HTTP for decisions), with every body and event validated.
"""

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

pytestmark = pytest.mark.e2e
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
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
TOOLS = [WEATHER_TOOL, ADD_TOOL]  # the tools tiny-glm was trained with
FUNCTIONS = [
    {"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
    for t in TOOLS
]
PARIS_WEATHER = '{"city": "Paris", "temperature": 18, "condition": "sunny"}'


def _texts(message: Message) -> list[tuple[str, str]]:
    return [(b.type, getattr(b, "text", None) or getattr(b, "thinking", "")) for b in message.content]


@pytest.fixture(scope="module")
def oai(glm_base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{glm_base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(glm_base_url: str) -> anthropic.Anthropic:
    """An Anthropic client as Claude Code makes one from ANTHROPIC_BASE_URL."""
    return anthropic.Anthropic(base_url=glm_base_url, api_key="unused", max_retries=0, timeout=120)


def test_messages_whole_and_streamed_with_thinking(claude: anthropic.Anthropic, glm_base_url: str) -> None:
    fields = {
        "model": "tiny",
        "max_tokens": 64,
        "messages": CAPITAL,
        "thinking": {"type": "adaptive"},
        "extra_body": {"temperature": 0},
    }
    whole = claude.messages.create(**fields)  # type: ignore[arg-type]
    Message.model_validate(whole.model_dump())
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[1].text == "The capital of France is Paris."  # type: ignore[union-attr]
    with claude.messages.stream(**fields) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_message()
    assert _texts(final) == _texts(whole) and final.stop_reason == "end_turn"
    assert {"message_start", "content_block_delta", "message_stop"} <= {e.type for e in events}
    counted = claude.messages.count_tokens(model="tiny", messages=CAPITAL, thinking={"type": "adaptive"})
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    refused = httpx.post(f"{glm_base_url}/v1/messages", json={"model": "tiny", "messages": CAPITAL})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = claude.messages.create(model="tiny", max_tokens=64, messages=ask, tools=TOOLS, extra_body={"temperature": 0})
    assert call.stop_reason == "tool_use"
    block = call.content[0]
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    result = {
        "type": "tool_result",
        "tool_use_id": block.id,
        "content": '{"city": "Paris", "temperature": 18, "condition": "sunny"}',
    }
    answer = claude.messages.create(
        model="tiny",
        max_tokens=64,
        tools=TOOLS,
        extra_body={"temperature": 0},
        messages=[*ask, {"role": "assistant", "content": call.content}, {"role": "user", "content": [result]}],
    )
    assert answer.content[0].text == "It is sunny in Paris, 18 °C."  # type: ignore[union-attr]
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prompt resumed from the prefix cache


def test_responses_stream_store_and_continue(oai: openai.OpenAI) -> None:
    events = list(
        oai.responses.create(
            model="tiny",
            input="What is the weather in Paris?",
            tools=FUNCTIONS,
            temperature=0,
            stream=True,
            extra_body=NO_THINK,
        )
    )
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first = events[-1].response
    assert events[-1].type == "response.completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}'
    stored = oai.responses.retrieve(first.id)  # kept by the ResponseStore deployment
    Response.model_validate(stored.model_dump())
    assert stored.output[0].call_id == call.call_id
    follow = oai.responses.create(
        model="tiny",
        previous_response_id=first.id,
        tools=FUNCTIONS,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": PARIS_WEATHER}],
        extra_body=NO_THINK,
    )
    assert follow.output_text == "It is sunny in Paris, 18 °C."
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the stored turn's prompt resumed from the cache
    assert oai.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(model="tiny", input="hi", previous_response_id=first.id)
    assert refused.value.param == "previous_response_id"
