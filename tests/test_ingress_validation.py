"""Request validation and error envelopes of the OpenAI routes: everything refused before the engine.

The routes run over the real renderer (tokenizer + tiny-glm template) with no engine behind them: every
request here must be answered before generation would start.
"""

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.api import build_api
from deployments.ingress.context import IngressSettings
from deployments.ingress.local_backend import LocalBackend
from deployments.ingress.openai_models import ChatCompletionRequest, CompletionRequest, unsupported_field
from deployments.renderer.prompt_renderer import PromptRenderer
from deployments.types import Priority

REPO = Path(__file__).resolve().parents[1]
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out, vocab_size=512, family="glm")
    template = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
    (out / "chat_template.jinja").write_text(template.read_text(encoding="utf-8"), encoding="utf-8")
    backend = LocalBackend(PromptRenderer.from_checkpoint(out), loop=None)  # type: ignore[arg-type]
    app = build_api(backend, IngressSettings(served_name="m", model_ids=["m", "alias"]))
    return TestClient(app, raise_server_exceptions=False)


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", True), ("temperature", "hot"), ("temperature", -0.5), ("temperature", "inf"),
        ("top_p", False), ("top_p", 0), ("top_p", 1.5), ("top_p", "nan"),
        ("top_k", 2.5), ("top_k", True), ("top_k", "many"),
        ("min_p", 1.5), ("min_p", -0.1), ("min_p", True),
        ("seed", 1.5), ("seed", True), ("seed", "abc"), ("seed", 2**70),
        ("ignore_eos", "yes"), ("ignore_eos", 1),
        ("stop", 5), ("stop", ["ok", 3]), ("stop", [""]), ("stop", {"a": 1}),
        ("n", 2), ("n", 0), ("max_tokens", 0), ("max_tokens", 1.5), ("max_completion_tokens", True),
        ("stop_token_ids", [1, "x"]), ("priority", "urgent"), ("chat_template_kwargs", "enable_thinking"),
        ("stream", "yes"), ("logprobs", "yes"), ("response_format", {"type": "yaml"}),
        ("frequency_penalty", 0.5),
    ],
)  # fmt: skip
def test_malformed_fields_are_400_naming_the_field(client: TestClient, field: str, value: object) -> None:
    response = client.post("/v1/chat/completions", content=json.dumps({"messages": USER, field: value}))
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field, error


@pytest.mark.parametrize("body", [{"prompt": "x", "temperature": True}, {"prompt": "x", "n": 3},
                                  {"prompt": "x", "ignore_eos": "no"}, {"prompt": ["a", "b"]}])  # fmt: skip
def test_completions_share_the_validation(client: TestClient, body: dict) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400 and _error(response)["param"] in {"temperature", "n", "ignore_eos", "prompt"}


def test_non_finite_json_numbers_are_refused(client: TestClient) -> None:
    raw = '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'  # Python's json accepts NaN
    response = client.post("/v1/chat/completions", content=raw)
    assert response.status_code == 400 and _error(response)["param"] == "temperature"


def test_invalid_json_and_non_object_bodies(client: TestClient) -> None:
    for raw in (b"{not json", b"[1, 2]", b""):
        response = client.post("/v1/chat/completions", content=raw)
        assert response.status_code == 400 and _error(response)["param"] is None
    assert client.post("/v1/completions", content=b"{").status_code == 400


def test_bad_messages_are_400_on_messages(client: TestClient) -> None:
    for messages in ([], [{"role": "wizard", "content": "x"}], "hello",
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}]):  # fmt: skip
        response = client.post("/v1/chat/completions", json={"messages": messages})
        assert response.status_code == 400 and _error(response)["param"] == "messages", response.text


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


def test_models_lists_the_served_name_then_aliases(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["m", "alias"]


def test_valid_bodies_parse_to_typed_values() -> None:
    chat = ChatCompletionRequest.model_validate({"messages": USER, "temperature": "0.7", "top_k": 5.0,
                                                 "seed": "42", "stop": "END", "priority": "background",
                                                 "max_completion_tokens": 9, "max_tokens": 3})  # fmt: skip
    assert (chat.temperature, chat.top_k, chat.seed, chat.stop) == (0.7, 5, 42, ["END"])
    assert chat.priority is Priority.BACKGROUND and chat.reply_limit == 9
    assert ChatCompletionRequest.model_validate({"messages": USER, "priority": 5}).priority is Priority.BACKGROUND
    nulls = ChatCompletionRequest.model_validate({"messages": USER, "temperature": None, "stop": None, "n": 1})
    assert nulls.temperature is None and nulls.stop == [] and nulls.reply_limit is None
    assert CompletionRequest.model_validate({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    assert unsupported_field({"logprobs": False, "response_format": {"type": "text"}, "top_logprobs": 0}) is None
