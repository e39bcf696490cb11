"""Structured output and logprobs over the real routes, renderer and engine (in-process, tiny-glm).

Refusals come as 400s in the route's format before any token; constrained replies match their grammar
(after the think block when thinking is on); logprob rows line up with the text, streamed or not.
"""

import json
import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion

from deployments.chat_format.rendering import PromptRenderer
from tests.support.bodies import USER
from tests.support.local_app import local_client

NO_THINK = {"enable_thinking": False}
# 71 levels, past the body's own nesting limit (64), which holds inside a schema sent as text too (xgrammar
# takes seconds over one hundreds deep)
DEEP_SCHEMA = '{"type": "array", "items": ' * 70 + "{}" + "}" * 70
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(served_model: str) -> Iterator[TestClient]:
    with local_client(served_model, window=400) as test_client:
        yield test_client


def _chat(client: TestClient, **fields: object) -> dict:
    return client.post("/v1/chat/completions", json={"messages": USER, "temperature": 0, **fields}).json()


def _events(text: str) -> list[dict]:
    blocks = [b[len("data: ") :] for b in text.split("\n\n") if b.startswith("data: ")]
    return [json.loads(b) for b in blocks if b != "[DONE]"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format.json_schema.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice"),
        ({"guided_json": DEEP_SCHEMA}, "guided_json"),  # as text it escapes the body's nesting limit
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        ({"guided_json": '{"maxLength": ' + "9" * 4301 + "}"}, "guided_json"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_regex": "a+", "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"logprobs": True, "guided_regex": "a+"}, "logprobs"),
        ({"logprobs": True, "stop": ["x"]}, "stop"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_refusals_come_before_any_token(client: TestClient, fields: dict, param: str) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


TEMPLATE_REFUSES = [{"role": "function", "content": "x"}]  # tiny-glm's template has no such role: a 400 once rendered
NEVER_COMPILES = {"type": "nope"}  # a JSON schema xgrammar refuses


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": TEMPLATE_REFUSES, "guided_regex": "(("}, "guided_regex"),
        ("/v1/chat/completions", {"messages": TEMPLATE_REFUSES, "guided_json": NEVER_COMPILES}, "guided_json"),
        ("/v1/chat/completions", {"messages": TEMPLATE_REFUSES, "logprobs": True, "stop": "x"}, "stop"),
        ("/v1/chat/completions", {"messages": TEMPLATE_REFUSES, "logprobs": 1}, "logprobs"),
        (
            "/v1/chat/completions",
            {
                "messages": TEMPLATE_REFUSES,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ("/v1/completions", {"prompt": "x" * 100, "structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "guided_regex": "a+"}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (
            "/v1/responses",
            {"input": TEMPLATE_REFUSES, "text": {"format": {"type": "json_schema", "schema": NEVER_COMPILES}}},
            "text.format.schema",
        ),
    ],
)
def test_grammar_and_logprob_refusals_come_before_the_prompt_is_rendered_or_tokenised(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, path: str, body: dict, param: str
) -> None:
    worked: list[str] = []
    for name in ("render_or_refuse", "tokenize"):
        original = getattr(PromptRenderer, name)
        monkeypatch.setattr(
            PromptRenderer, name, lambda self, *a, _o=original, _n=name: worked.append(_n) or _o(self, *a)
        )
    reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and worked == []


def test_messages_refuse_an_output_schema_before_rendering(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PromptRenderer, "render_or_refuse", lambda *a: pytest.fail("rendered"))
    output = {"format": {"type": "json_schema", "schema": NEVER_COMPILES}}
    reply = client.post("/v1/messages", json={"messages": USER, "max_tokens": 8, "output_config": output})
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    assert reply.json()["error"]["message"].startswith("output_config.format.schema: the grammar does not compile")


def test_an_uncompilable_grammar_names_xgrammars_reason(client: TestClient) -> None:
    error = _chat(client, guided_regex="((")["error"]
    assert "parenthesis" in error["message"]


def test_constrained_replies_match_their_grammar(client: TestClient) -> None:
    choice = _chat(client, max_tokens=60, guided_choice=["Paris", "Rome"])  # thinking on: grammar after it
    message = ChatCompletion.model_validate(choice).choices[0].message
    assert message.content in ("Paris", "Rome") and message.model_extra.get("reasoning_content")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    body = _chat(
        client,
        max_tokens=60,
        chat_template_kwargs=NO_THINK,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    value = json.loads(body["choices"][0]["message"]["content"])
    assert isinstance(value["city"], str) and len(value["city"]) <= 10
    body = _chat(client, max_tokens=30, chat_template_kwargs=NO_THINK, structured_outputs={"regex": r"[A-Z][a-z]{2,5}"})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}", body["choices"][0]["message"]["content"])


def test_a_schema_sent_with_json_object_is_enforced(client: TestClient) -> None:
    # instructor and other OpenAI-compatible clients send {"type": "json_object", "schema": ...}.
    schema = {"type": "object", "properties": {"n": {"enum": [7]}}, "required": ["n"], "additionalProperties": False}
    body = _chat(
        client, max_tokens=40, chat_template_kwargs=NO_THINK, response_format={"type": "json_object", "schema": schema}
    )
    assert json.loads(body["choices"][0]["message"]["content"]) == {"n": 7}
    refused = client.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object", "schema": "x"}}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.schema"


def test_chat_logprobs_streamed_equal_whole_and_cover_the_answer(client: TestClient) -> None:
    fields = {"max_tokens": 60, "logprobs": True, "top_logprobs": 2}
    whole = _chat(client, **fields)
    ChatCompletion.model_validate(whole)
    rows = whole["choices"][0]["logprobs"]["content"]
    content = whole["choices"][0]["message"]["content"]
    assert content and "".join(r["token"] for r in rows) == content  # the answer only: no reasoning rows
    assert all(len(r["top_logprobs"]) == 2 and r["top_logprobs"][0]["logprob"] >= r["logprob"] for r in rows)
    stream = client.post("/v1/chat/completions", json={"messages": USER, "temperature": 0, "stream": True, **fields})
    streamed = [
        row for e in _events(stream.text) for c in e["choices"] if c.get("logprobs") for row in c["logprobs"]["content"]
    ]
    assert streamed == rows
    sampled = _chat(client, **fields, temperature=0.9, seed=3)["choices"][0]["logprobs"]["content"]
    assert sampled[0]["top_logprobs"] == rows[0]["top_logprobs"]  # the raw distribution, not the sampled one


def test_completion_legacy_logprobs(client: TestClient) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    reply = client.post("/v1/completions", json=body).json()
    Completion.model_validate(reply)
    choice = reply["choices"][0]
    legacy = choice["logprobs"]
    assert "".join(legacy["tokens"]) == choice["text"]
    assert legacy["text_offset"] == [sum(len(t) for t in legacy["tokens"][:i]) for i in range(len(legacy["tokens"]))]
    assert all(len(top) >= 2 for top in legacy["top_logprobs"])
    stream = client.post("/v1/completions", json={**body, "stream": True})
    rows = [c["logprobs"] for e in _events(stream.text) for c in e["choices"] if c.get("logprobs")]
    assert sum((r["tokens"] for r in rows), []) == legacy["tokens"]
    assert sum((r["text_offset"] for r in rows), []) == legacy["text_offset"]
    refused = client.post("/v1/completions", json={**body, "logprobs": 21})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"


def test_forced_tool_calls_write_a_call_to_an_offered_tool(client: TestClient) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for stream in (False, True):
            body = {
                "messages": USER,
                "temperature": 0,
                "max_tokens": 60,
                "tools": [weather, clock],
                "tool_choice": choice,
                "parallel_tool_calls": False,
                "stream": stream,
            }
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            if stream:
                deltas = [ch["delta"] for e in _events(reply.text) for ch in e["choices"]]
                calls = [c for d in deltas for c in (d.get("tool_calls") or []) if c.get("function", {}).get("name")]
            else:
                calls = reply.json()["choices"][0]["message"].get("tool_calls") or []
            names = [c["function"]["name"] for c in calls]
            offered = ("get_weather", "get_time") if choice == "required" else ("get_time",)
            assert len(names) == 1 and names[0] in offered
    missing = {"messages": USER, "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    refused = client.post("/v1/chat/completions", json=missing)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
