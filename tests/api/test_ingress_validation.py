"""Request validation and error envelopes of the OpenAI routes: everything refused before the engine.

The routes run over the real renderer (tokenizer + tiny-glm template) with no engine behind them: every
request here must be answered before generation would start. Tool definitions are checked on every route
that takes tools (chat, completions with messages, /tokenize, Responses, Messages), naming the tool field.
"""

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.ingress.app import build_api
from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.context import IngressSettings
from deployments.ingress.openai.models import CompletionRequest
from deployments.ingress.request_fields import unsupported_field
from deployments.ingress.tool_checks import CHAT, MESSAGES, RESPONSES, check_tools
from deployments.messages.requests import Priority
from serve_app.local_backend import LocalBackend

REPO = Path(__file__).resolve().parents[2]
JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, vocab_size=512, family="glm")
    template = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
    (out / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    backend = LocalBackend(PromptRenderer.from_checkpoint(out), loop=None)  # no engine: nothing may reach one
    app = build_api(backend, IngressSettings(served_name="m", model_ids=["m", "alias"]))
    return TestClient(app, raise_server_exceptions=False)


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", True),
        ("temperature", "hot"),
        ("temperature", -0.5),
        ("temperature", "inf"),
        ("top_p", False),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", "nan"),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_k", "many"),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_p", True),
        ("seed", 1.5),
        ("seed", True),
        ("seed", "abc"),
        ("seed", 2**70),
        ("ignore_eos", "yes"),
        ("ignore_eos", 1),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop", {"a": 1}),
        ("n", 2),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("max_completion_tokens", True),
        ("stop_token_ids", [1, "x"]),
        ("priority", "urgent"),
        ("chat_template_kwargs", "enable_thinking"),
        ("stream", "yes"),
        ("logprobs", "yes"),
        ("frequency_penalty", 0.5),
    ],
)
def test_malformed_fields_are_400_naming_the_field(client: TestClient, field: str, value: object) -> None:
    response = client.post("/v1/chat/completions", content=json.dumps({"messages": USER, field: value}), headers=JSON)
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field, error


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "temperature": True},
        {"prompt": "x", "n": 3},
        {"prompt": "x", "ignore_eos": "no"},
        {"prompt": ["a", "b"]},
    ],
)
def test_completions_share_the_validation(client: TestClient, body: dict) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and _error(response)["param"] in {"temperature", "n", "ignore_eos", "prompt"}


def test_non_finite_json_numbers_are_refused(client: TestClient) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'  # Python's json accepts NaN
    response = client.post("/v1/chat/completions", content=raw, headers=JSON)
    assert response.status_code == 400 and _error(response)["param"] == "temperature"


def test_invalid_json_and_non_object_bodies(client: TestClient) -> None:
    for raw in (b"{not json", b"[1, 2]", b""):
        response = client.post("/v1/chat/completions", content=raw, headers=JSON)
        assert response.status_code == 400 and _error(response)["param"] is None
    assert client.post("/v1/completions", content=b"{", headers=JSON).status_code == 400


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"],
)
def test_a_body_not_sent_as_json_is_415_on_every_route(client: TestClient, content_type: str | None) -> None:
    # What a web page may POST to another origin without a preflight: a keyless local server must not run it.
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"messages": USER, "prompt": "hi", "input": "hi", "max_tokens": 4}).encode()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        response = client.post(path, content=body, headers=headers)
        assert response.status_code == 415, (path, response.text)
        assert _error(response)["code"] == "unsupported_media_type"
    anthropic = client.post("/v1/messages", content=body, headers=headers)
    assert anthropic.status_code == 415 and anthropic.json()["type"] == "error"
    for sent in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        read = client.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": sent})
        assert read.status_code == 400 and _error(read)["param"] == "messages", (sent, read.text)  # parsed


def test_bad_messages_are_400_naming_the_message_or_its_part(client: TestClient) -> None:
    for messages, param in (
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([USER[0], 5], "messages[1]"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0].image_url"),
        (
            [USER[0], {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 7}}]}],
            "messages[1].content[0].image_url.url",
        ),
    ):
        response = client.post("/v1/chat/completions", json={"messages": messages})
        assert response.status_code == 400 and _error(response)["param"] == param, response.text
        assert _error(response)["message"].startswith(f"{param}: ")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]
    response = client.post("/v1/chat/completions", json={"messages": image})  # a text-only server: the part
    assert response.status_code == 400 and _error(response)["param"] == "messages[0].content[0].image_url"


def test_template_refusal_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "function", "content": "x"}]})
    assert response.status_code == 400
    assert "no role named function" in _error(response)["message"]


def test_out_of_vocabulary_ids_are_refused(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": [1, 2, 99999]})
    assert response.status_code == 400 and _error(response)["param"] == "prompt"
    response = client.post("/v1/chat/completions", json={"messages": USER, "stop_token_ids": [99999]})
    assert response.status_code == 400 and _error(response)["param"] == "stop_token_ids"
    response = client.post("/detokenize", json={"tokens": [99999]})
    assert response.status_code == 400 and _error(response)["param"] == "tokens"


def test_unknown_route_is_an_error_envelope(client: TestClient) -> None:
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and _error(response)["type"] == "not_found_error"


def test_models_lists_no_model_while_no_engine_answers(client: TestClient) -> None:
    body = client.get("/v1/models").json()  # the names once an engine answers: tests/api/test_loading_window.py
    assert body == {"object": "list", "data": []}


def test_valid_bodies_parse_to_typed_values() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": USER,
            "temperature": "0.7",
            "top_k": 5.0,
            "seed": "42",
            "stop": "END",
            "priority": "background",
            "max_completion_tokens": 9,
            "max_tokens": 3,
        }
    )
    assert (chat.temperature, chat.top_k, chat.seed, chat.stop) == (0.7, 5, 42, ["END"])
    assert chat.priority is Priority.BACKGROUND and chat.reply_limit == 9
    assert ChatCompletionRequest.model_validate({"messages": USER, "priority": 5}).priority is Priority.BACKGROUND
    nulls = ChatCompletionRequest.model_validate({"messages": USER, "temperature": None, "stop": None, "n": 1})
    assert nulls.temperature is None and nulls.stop == [] and nulls.reply_limit is None
    assert CompletionRequest.model_validate({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert unsupported_field({"logprobs": False, "response_format": {"type": "text"}, "top_logprobs": 0}) is None


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _chat_tool(**function: object) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, **function}}


BAD_CHAT_TOOLS = [  # (tools, the param named, words in the message)
    ([{"type": "function", "function": {}}], "tools[0].function.name", "is required"),
    ([{"type": "function"}], "tools[0].function", "is required"),
    ([{"type": "function", "function": "get_weather"}], "tools[0].function", "must be an object"),
    ([_chat_tool(name="get weather")], "tools[0].function.name", "^[a-zA-Z0-9_-]{1,64}$"),
    ([_chat_tool(name="files.read")], "tools[0].function.name", "does not match"),
    ([_chat_tool(name="")], "tools[0].function.name", "does not match"),
    ([_chat_tool(name="a" * 65)], "tools[0].function.name", "at most 64"),
    ([_chat_tool(name=7)], "tools[0].function.name", "must be a string"),
    ([_chat_tool(parameters="city: string")], "tools[0].function.parameters", "JSON Schema object"),
    ([_chat_tool(parameters=[WEATHER])], "tools[0].function.parameters", "JSON Schema object"),
    ([_chat_tool(parameters={"type": "string"})], "tools[0].function.parameters", "object schema"),
    ([_chat_tool(description=5)], "tools[0].function.description", "must be a string"),
    ([_chat_tool(strict="yes")], "tools[0].function.strict", "must be a boolean"),
    ([{**_chat_tool(), "type": "custom"}], "tools[0].type", "'function'"),
    ([_chat_tool(), _chat_tool(name="add"), _chat_tool(name="add")], "tools[2].function.name", "unique"),
    ([_chat_tool(), {"type": "function", "function": {"parameters": WEATHER}}], "tools[1].function.name", "required"),
    ([5], "tools[0]", "must be an object"),
    ("get_weather", "tools", "must be an array"),
]


@pytest.mark.parametrize(("tools", "param", "words"), BAD_CHAT_TOOLS)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_chat_tools_are_checked_as_openai_does(
    client: TestClient, route: str, tools: object, param: str, words: str
) -> None:
    response = client.post(route, json={"messages": USER, "tools": tools, "tool_choice": "required"})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(param) and words in error["message"], error


def _response_tool(**fields: object) -> dict:
    return {"type": "function", "name": "get_weather", "parameters": WEATHER, **fields}


@pytest.mark.parametrize(
    ("tools", "param", "words"),
    [
        ([{"type": "function"}], "tools[0].name", "is required"),
        ([_response_tool(name="get weather")], "tools[0].name", "does not match"),
        ([_response_tool(name="b" * 65)], "tools[0].name", "at most 64"),
        ([_response_tool(parameters={"type": "array"})], "tools[0].parameters", "object schema"),
        ([_response_tool(parameters=True)], "tools[0].parameters", "JSON Schema object"),
        ([_response_tool(), _response_tool()], "tools[1].name", "unique"),
    ],
)
def test_responses_tools_are_checked_as_openai_does(client: TestClient, tools: list, param: str, words: str) -> None:
    response = client.post("/v1/responses", json={"input": "Hello", "tools": tools})
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param and words in error["message"], error


def _anthropic_tool(**fields: object) -> dict:
    return {"name": "get_weather", "input_schema": WEATHER, **fields}


@pytest.mark.parametrize(
    ("tools", "words"),
    [
        ([{"input_schema": WEATHER}], "tools[0].name: is required"),
        ([_anthropic_tool(name="mcp__files.read")], "tools[0].name: 'mcp__files.read' does not match"),
        ([_anthropic_tool(name="c" * 129)], "tools[0].name: is 129 characters long"),
        ([_anthropic_tool(input_schema=None)], "tools[0].input_schema: must be a JSON Schema object"),
        ([_anthropic_tool(input_schema={"type": "string"})], "tools[0].input_schema: must be an object schema"),
        ([_anthropic_tool(), _anthropic_tool(name="x"), _anthropic_tool()], "tools[2].name: 'get_weather' is already"),
    ],
)
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_messages_tools_are_checked_in_anthropics_envelope(
    client: TestClient, route: str, tools: list, words: str
) -> None:
    body = {"model": "m", "max_tokens": 16, "messages": USER, "tools": tools, "tool_choice": {"type": "any"}}
    response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert words in response.json()["error"]["message"], response.json()


def test_names_at_each_vendors_length_limit_pass() -> None:
    check_tools([_chat_tool(name="a" * 64), _chat_tool(name="Get-Weather_2", parameters=None)], CHAT)
    check_tools([_response_tool(name="b" * 64), {"type": "function", "name": "now"}], RESPONSES)
    check_tools([_anthropic_tool(name="mcp__" + "c" * 123), _anthropic_tool(input_schema={"properties": {}})], MESSAGES)
    check_tools([], CHAT)
    check_tools(None, MESSAGES)


def test_a_wrong_method_is_405_naming_the_allowed_ones(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert _error(response)["type"] == "invalid_request_error"


def test_detokenize_refuses_null_tokens(client: TestClient) -> None:
    for tokens in (None, "1 2", [1, -2]):
        response = client.post("/detokenize", json={"tokens": tokens})
        assert response.status_code == 400 and _error(response)["param"] == "tokens", response.text
