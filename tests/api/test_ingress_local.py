"""The OpenAI routes over the real renderer and engine, in-process (no Ray): bodies, streams, refusals.

Responses are validated against the `openai` SDK's types; streamed text and usage must equal the
non-streamed ones for the same seed; the finish log names every reply id.
"""

import hashlib
import json
import logging
import struct

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER

WINDOW = 160


@pytest.fixture(scope="module")
def client(served_model: str) -> TestClient:
    from deployments.scheduler.engine.core import Engine
    from deployments.scheduler.transports.thread import EngineLoop
    from serve_app.args import AppArgs

    model_dir = AppArgs(model=served_model).model_dir
    engine = Engine(EngineConfig(model=str(model_dir), context=WINDOW, kv_cache_gib=0.05, device="cpu"))
    loop = EngineLoop(engine)
    loop.start()
    app = build_api(
        LocalBackend(PromptRenderer.from_checkpoint(model_dir), loop),
        IngressSettings(served_name="tiny", model_ids=["tiny", "other"]),
    )
    with TestClient(app) as test_client:
        yield test_client
    loop.shutdown()


def sse_events(text: str) -> list[dict | str]:
    events: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_body_validates_and_carries_usage_and_runtime(client: TestClient) -> None:
    body = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    ).json()
    reply = ChatCompletion.model_validate(body)
    assert reply.id.startswith("chatcmpl-") and reply.model == "tiny"
    assert reply.choices[0].finish_reason in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0
    assert "reasoning_tokens" in usage["completion_tokens_details"]
    token_ids = body["choices"][0]["token_ids"]
    assert len(token_ids) == usage["completion_tokens"] and len(body["prompt_token_ids"]) == usage["prompt_tokens"]
    runtime = body["tensorfold"]
    for key in (
        "engine",
        "tokens_per_second",
        "seconds",
        "time_to_first_token",
        "prefill_seconds",
        "prefill_widths",
        "sampling",
        "token_sha",
        "rounds",
    ):
        assert key in runtime, key
    assert runtime["token_sha"] == hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()
    assert sum(runtime["prefill_widths"]) + usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"]


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_equals_non_stream_for_the_same_seed(client: TestClient, include_usage: bool) -> None:
    request = {"messages": USER, "max_tokens": 16, "temperature": 0.9, "seed": 11}
    whole = client.post("/v1/chat/completions", json=request).json()
    streamed = client.post(
        "/v1/chat/completions", json={**request, "stream": True, "stream_options": {"include_usage": include_usage}}
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole["choices"][0]["message"]["content"]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole["choices"][0]["finish_reason"]
    usage_events = [e for e in events[:-1] if e.get("usage")]
    assert len(usage_events) == 1 and usage_events[0] is events[-2]
    assert usage_events[0]["usage"] == whole["usage"]
    assert usage_events[0]["tensorfold"]["token_sha"] == whole["tensorfold"]["token_sha"]
    if include_usage:
        assert usage_events[0]["choices"] == [] and all("usage" in e for e in events[:-1])
    else:
        assert usage_events[0]["choices"][0]["finish_reason"] is not None


def test_completions_with_text_and_token_ids(client: TestClient) -> None:
    body = client.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "return_token_ids": True},
    ).json()
    completion = Completion.model_validate(body)
    assert completion.object == "text_completion" and body["id"].startswith("cmpl-")
    prompt_ids = body["choices"][0]["prompt_token_ids"]
    again = client.post("/v1/completions", json={"prompt": prompt_ids, "max_tokens": 6, "temperature": 0}).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]
    tokenized = client.post("/tokenize", json={"prompt": "The capital of France is", "add_special_tokens": False})
    assert tokenized.json()["tokens"] == prompt_ids
    streamed = sse_events(
        client.post(
            "/v1/completions", json={"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "stream": True}
        ).text
    )
    # The SDK types a stream's chunks as Completion but builds them unvalidated: finish_reason is null
    # until the last one, as OpenAI sends it. Validate the finished chunk; the rest by shape.
    assert all(set(e["choices"][0]) == {"index", "text", "logprobs", "finish_reason"} for e in streamed[:-2])
    Completion.model_validate(streamed[-2])
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == body["choices"][0]["text"]


def test_completions_with_messages_take_the_chat_path(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"messages": USER, "max_tokens": 4, "temperature": 0}).json()
    assert ChatCompletion.model_validate(body).object == "chat.completion"


def test_tokenize_messages_gives_the_ids_the_chat_route_runs(client: TestClient) -> None:
    chat = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "return_token_ids": True})
    for route in ("/tokenize", "/v1/tokenize"):
        tokenized = client.post(route, json={"messages": USER, "return_token_strs": True}).json()
        assert tokenized["tokens"] == chat.json()["prompt_token_ids"]
        assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == WINDOW
        assert len(tokenized["token_strs"]) == tokenized["count"]
    text = client.post("/v1/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text.startswith("[gMASK]<sop><|user|>What is the capital")


def test_context_refusals(client: TestClient) -> None:
    too_long = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": WINDOW})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"  # docs/api.md's and OpenAI's field, whichever limit overflowed
    assert error["message"].startswith(f"This server's maximum context length is {WINDOW} tokens")
    named = client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": WINDOW})
    assert named.json()["error"]["param"] == "messages"
    completion = client.post("/v1/completions", json={"prompt": "The capital of", "max_tokens": WINDOW})
    assert completion.json()["error"]["param"] == "prompt"
    assert completion.json()["error"]["code"] == "context_length_exceeded"
    huge = [{"role": "user", "content": "word " * (WINDOW * 2)}]
    for route, body, param in (
        ("/v1/chat/completions", {"messages": huge}, "messages"),
        ("/v1/completions", {"prompt": "word " * (WINDOW * 2)}, "prompt"),
    ):
        refused = client.post(route, json={**body, "stream": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
        assert refused.json()["error"]["code"] == "context_length_exceeded"


def test_an_omitted_limit_is_capped_to_the_remaining_context(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "ignore_eos": True, "temperature": 0}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == WINDOW


def test_health_fields_in_their_documented_order(client: TestClient) -> None:
    body = client.get("/health").json()
    assert list(body)[:11] == [
        "status",
        "model",
        "model_ids",
        "max_batch_size",
        "vision",
        "policy",
        "weights",
        "warming",
        "memory",
        "live",
        "version",
    ]
    assert body["status"] == "ok" and body["model_ids"] == ["tiny", "other"] and body["warming"] is False
    assert body["weights"]["format"] == "float32" and body["weights"]["bytes"] > 0
    assert set(body["live"]) == {"connections", "waiting", "decode_tokens_per_second", "prefill_tokens_per_second"}
    assert body["context_length"] == WINDOW and "backend" not in body  # CPU: no GPU backend built in
    assert client.get("/").json()["model"] == "tiny"


def test_finish_log_names_each_reply(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tensorfold.requests"):
        done = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3}).json()
        refused = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": WINDOW * 2})
    lines = [r.getMessage() for r in caplog.records if r.name == "tensorfold.requests"]
    assert any(line.startswith(f"finished {done['id']} prompt=") and " sha=" in line for line in lines), lines
    assert any(line.startswith("refused chatcmpl-") and "maximum context length" in line for line in lines)
    assert refused.status_code == 400
