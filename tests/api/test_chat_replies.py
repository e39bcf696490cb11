"""Chat replies over the real routes, renderer and engine in-process (tiny-glm writes reasoning and GLM
tool calls from its script): reasoning split, tool calls, streamed == whole, thinking budget, effort."""

import json

import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deployments.chat_format.rendering import PromptRenderer
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.fixtures.tiny_glm.corpus import CONVERSATIONS, TOOLS
from serve_app.local_backend import LocalBackend

BY_NAME = {c.name: c for c in CONVERSATIONS}


@pytest.fixture(scope="module")
def client(served_model: str) -> TestClient:
    from deployments.config import EngineConfig
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    loop = EngineLoop(Engine(EngineConfig(model=str(model_dir), context=640, kv_cache_gib=0.05, device="cpu")))
    loop.start()
    app = build_api(
        LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop),
        IngressSettings(served_name="tiny", model_ids=["tiny"]),
    )
    with TestClient(app) as test_client:
        yield test_client
    loop.shutdown()


def _body(name: str, **extra) -> dict:
    conv = BY_NAME[name]
    body = {"messages": conv.messages, "temperature": 0, "max_tokens": 60, **extra}
    if conv.tools:
        body["tools"] = conv.tools
    if conv.enable_thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": conv.enable_thinking}
    return body


def _both(client: TestClient, body: dict, route: str = "/v1/chat/completions") -> tuple[dict, dict]:
    """The whole reply, and the streamed one folded into the same message shape."""
    whole = client.post(route, json=body).json()
    ChatCompletion.model_validate(whole)
    text = client.post(route, json={**body, "stream": True}).text
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for block in text.split("\n\n"):
        if not block.startswith("data: {"):
            continue
        ChatCompletionChunk.model_validate(json.loads(block[6:]))  # the SDK's types accept every event
        for choice in json.loads(block[6:])["choices"]:
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                slot = message["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                slot["name"] += call.get("function", {}).get("name") or ""
                slot["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    message["finish_reason"] = finish
    return whole, message


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


def test_reasoning_is_split_from_content_streamed_and_whole(client: TestClient) -> None:
    for route in ("/v1/chat/completions", "/v1/completions"):
        whole, streamed = _both(client, _body("capital_thinking"), route)
        message = whole["choices"][0]["message"]
        assert message["content"] == "The capital of France is Paris."
        assert message["reasoning_content"] == "The user asks for the capital of France. It is Paris."
        assert message["reasoning"] == message["reasoning_content"] and whole["choices"][0]["finish_reason"] == "stop"
        assert streamed["content"] == message["content"]
        assert streamed["reasoning_content"] == message["reasoning_content"]
        assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0


def test_tool_calls_streamed_and_whole_then_the_round_trip(client: TestClient) -> None:
    whole, streamed = _both(client, _body("parallel_calls"))
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" == streamed["finish_reason"] and choice["message"]["content"] is None
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]
    assert _calls(choice["message"]) == expected
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["tool_calls"].values()] == expected
    single = client.post("/v1/chat/completions", json=_body("parallel_calls", parallel_tool_calls=False)).json()
    assert _calls(single["choices"][0]["message"]) == expected[:1]
    assert single["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # The call goes back as an assistant turn with the tool's answer; the next turn answers from it.
    thinking, _ = _both(client, _body("weather_call_thinking"))
    message = thinking["choices"][0]["message"]
    assert message["reasoning_content"] == "I should call get_weather for Tokyo."
    assert _calls(message) == [("get_weather", {"city": "Tokyo"})]
    follow = _body("weather_answer_thinking")
    follow["messages"][1] = {
        "role": "assistant",
        "content": message["content"],
        "tool_calls": message["tool_calls"],
        "reasoning_content": message["reasoning_content"],
    }
    answer = client.post("/v1/chat/completions", json=follow).json()["choices"][0]["message"]
    assert answer["content"] == "It is rainy in Tokyo, 12 °C."


def test_thinking_budget_closes_the_block_and_the_answer_follows(client: TestClient) -> None:
    whole, streamed = _both(client, _body("multiply_thinking", thinking_budget=4))
    message = whole["choices"][0]["message"]
    # The answer is whatever tiny-glm writes after a close it was never trained on; reasoning stops at the cut.
    assert message["reasoning_content"] == "17" and message["content"]
    assert (streamed["reasoning_content"], streamed["content"]) == (message["reasoning_content"], message["content"])
    # <think>, "1", "7", then the forced "\n" (the 4th token) and "</think>".
    assert whole["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_effort_tokenize_and_tool_choice_none(client: TestClient) -> None:
    for field, value in (
        ("reasoning_effort", "ultra"),
        ("thinking_budget", -1),
        ("tool_choice", "sometimes"),
        ("parallel_tool_calls", "maybe"),
    ):
        bad = client.post("/v1/chat/completions", json={**_body("greeting"), field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    body = _body("weather_call")
    ids = client.post("/tokenize", json={"messages": body["messages"], "tools": TOOLS}).json()["tokens"]
    chat = client.post(
        "/v1/chat/completions", json={**body, "chat_template_kwargs": {}, "max_tokens": 1, "return_token_ids": True}
    ).json()
    assert chat["prompt_token_ids"] == ids
    hidden = client.post("/tokenize", json={"messages": body["messages"], "tools": TOOLS, "tool_choice": "none"})
    plain = client.post("/tokenize", json={"messages": body["messages"]})
    assert hidden.json()["tokens"] == plain.json()["tokens"] != ids
    off = client.post("/tokenize", json={"messages": body["messages"], "reasoning_effort": "none"}).json()["tokens"]
    assert (
        off
        == client.post(
            "/tokenize", json={"messages": body["messages"], "chat_template_kwargs": {"enable_thinking": False}}
        ).json()["tokens"]
    )
