"""The `draft` request field on every generation route, and the draft counters in each reply's runtime block.

The routes run over the real renderer (tiny-glm's tokenizer and template); in place of an engine, the
backend records each EngineRequest it is given and answers with one finished chunk whose stats carry the
draft counters a drafting engine reports. A bad `draft` must be refused before any request is built.
"""

import json
from collections.abc import AsyncIterator

import pytest
from fastapi.testclient import TestClient

from deployments.chat_format.rendering import PromptRenderer
from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from deployments.messages.counters import EngineCounters
from deployments.messages.replies import EngineChunk, FinishReason, RequestStats
from deployments.messages.requests import EngineRequest
from deployments.messages.status import ReplicaStatus
from serve_app.local_backend import LocalBackend
from tests.support.bodies import USER

ROUTES = {  # route -> a body that runs on it
    "/v1/chat/completions": {"messages": USER, "max_tokens": 16},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 16},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 16},
    "/v1/messages": {"messages": USER, "max_tokens": 16},
}
RUNTIME = {"drafts": "mtp", "drafted": 6, "accepted": 5, "acceptance_rate": 0.8333, "tokens_per_round": 2.667}


def _stats() -> RequestStats:
    """A 9-token reply in 3 decode rounds: 6 drafts verified, 5 kept."""
    return RequestStats(
        prompt_tokens=9,
        completion_tokens=9,
        rounds=3,
        draft_method="mtp",
        drafted=6,
        accepted=5,
        draft_rounds=3,
        accepted_per_position=[3, 2],
        decode_seconds=0.5,
    )


class _Reply:
    """One request's upstream: the whole reply in one finished chunk."""

    def __init__(self, chunk: EngineChunk) -> None:
        self._chunk = chunk

    def __aiter__(self) -> AsyncIterator[EngineChunk]:
        return self._play()

    async def _play(self) -> AsyncIterator[EngineChunk]:
        yield self._chunk

    async def close(self) -> None:
        pass


class _RecordingBackend(LocalBackend):
    """The real renderer; every EngineRequest is recorded and answered with a drafted reply."""

    def __init__(self, renderer: PromptRenderer) -> None:
        super().__init__(renderer, loop=None)
        self.requests: list[EngineRequest] = []
        self._reply_ids = renderer.tokenize("Paris is the capital of France, as it has been.", False)[:9]

    def stream(self, request: EngineRequest) -> _Reply:  # type: ignore[override]
        self.requests.append(request)
        text = self._renderer.detokenize(self._reply_ids)
        return _Reply(EngineChunk(request.request_id, list(self._reply_ids), text, FinishReason.LENGTH, stats=_stats()))

    async def replicas(self) -> list[ReplicaStatus]:
        return [
            ReplicaStatus(
                replica="r1",
                window=4096,
                lanes=8,
                policy="",
                block_size=16,
                num_blocks=64,
                kv_usage=0.0,
                running=0,
                waiting=0,
                decode_tokens_per_second=0.0,
                prefill_tokens_per_second=0.0,
                dtype="float32",
                device="cpu",
                device_name="cpu",
                model_type="glm4_moe",
                counters=EngineCounters(),
                drafts="mtp",
                draft_tokens=3,
            )
        ]


@pytest.fixture(scope="module")
def backend(served_model: str) -> _RecordingBackend:
    from serve_app.args import AppArgs

    return _RecordingBackend(PromptRenderer.from_checkpoint(AppArgs(model=served_model).model_dir))


@pytest.fixture(scope="module")
def client(backend: _RecordingBackend) -> TestClient:
    with TestClient(build_api(backend, IngressSettings(served_name="tiny", model_ids=["tiny"]))) as test_client:
        yield test_client


def _sent(client: TestClient, backend: _RecordingBackend, route: str, **fields: object) -> EngineRequest:
    before = len(backend.requests)
    reply = client.post(route, json={**ROUTES[route], **fields})
    assert reply.status_code == 200, reply.text
    assert len(backend.requests) == before + 1
    return backend.requests[-1]


@pytest.mark.parametrize("route", list(ROUTES))
def test_draft_reaches_the_engine_request(client: TestClient, backend: _RecordingBackend, route: str) -> None:
    assert _sent(client, backend, route).draft is True  # omitted: the engine's drafter
    assert _sent(client, backend, route, draft=None).draft is True  # null keeps the default
    assert _sent(client, backend, route, draft=True).draft is True
    assert _sent(client, backend, route, draft=False).draft is False  # the serial reference


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("value", ["false", "true", 0, 1, {}, [], 0.0])
def test_a_non_boolean_draft_is_400_before_any_work(
    client: TestClient, backend: _RecordingBackend, route: str, value: object
) -> None:
    before = len(backend.requests)
    for stream in (False, True):
        reply = client.post(route, json={**ROUTES[route], "draft": value, "stream": stream})
        assert reply.status_code == 400, reply.text
        body = reply.json()
        if route == "/v1/messages":  # Anthropic's envelope names no param: the message does
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith("draft must be a boolean"), body
        else:
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "draft", body
    assert len(backend.requests) == before  # refused before an EngineRequest was built


def _runtime(block: dict) -> dict:
    return {key: block[key] for key in RUNTIME}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_reply_carries_the_draft_counters(client: TestClient, route: str) -> None:
    assert _runtime(client.post(route, json=ROUTES[route]).json()["tensorfold"]) == RUNTIME


def _events(text: str) -> list[dict]:
    datas = [line.removeprefix("data: ") for line in text.split("\n") if line.startswith("data: ")]
    return [json.loads(data) for data in datas if data != "[DONE]"]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("include_usage", [False, True])
def test_the_streamed_final_event_carries_them(client: TestClient, route: str, include_usage: bool) -> None:
    body = {**ROUTES[route], "stream": True, "stream_options": {"include_usage": include_usage}}
    events = _events(client.post(route, json=body).text)
    blocks = [event.get("tensorfold") or event.get("response", {}).get("tensorfold") for event in events]
    carried = [block for block in blocks if block]
    assert len(carried) == 1, events  # once, on the final event
    assert _runtime(carried[0]) == RUNTIME
