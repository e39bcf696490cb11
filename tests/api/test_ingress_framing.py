"""Generation, SSE framing, usage and /health aggregation as pure logic, over scripted upstream items.

The upstream here is a list of real EngineChunk values played back in order; it stands in for a
Scheduler stream only to reach the failure paths (an engine error mid-stream, a stream that dies) that
a healthy engine never takes on purpose.
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import pytest

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.context import IngressSettings
from deployments.ingress.generation import Generation
from deployments.ingress.http.errors import APIError
from deployments.ingress.openai.framing import ChatFramer, ReplyMeta, json_body_of, stream_body
from deployments.ingress.ops.health import health_body
from deployments.ingress.usage import reasoning_tokens, token_sha
from deployments.messages.counters import EngineCounters
from deployments.messages.render import ReplyFormat
from deployments.messages.replies import EngineChunk, FinishReason, RequestStats
from deployments.messages.requests import EngineRequest
from deployments.messages.status import ReplicaStatus, UpstreamItem
from deployments.messages.window import reply_past_window


class _Playback:
    """Yields the given items, then raises `fail_with` if set; records whether it was closed."""

    def __init__(self, items: list[UpstreamItem], fail_with: Exception | None = None) -> None:
        self.items, self.fail_with, self.closed = items, fail_with, False

    def __aiter__(self) -> AsyncIterator[UpstreamItem]:
        return self._run()

    async def _run(self) -> AsyncIterator[UpstreamItem]:
        for item in self.items:
            yield item
        if self.fail_with is not None:
            raise self.fail_with

    async def close(self) -> None:
        self.closed = True


class _Backend:
    def __init__(self, upstream: _Playback) -> None:
        self.upstream = upstream

    def stream(self, request: EngineRequest) -> _Playback:
        return self.upstream


def _request() -> EngineRequest:
    return EngineRequest(request_id="chatcmpl-test", prompt_token_ids=[1, 2, 3])


def _stats(tokens: int) -> RequestStats:
    return RequestStats(
        prompt_tokens=3,
        completion_tokens=tokens,
        arrival_time=100.0,
        first_token_time=100.5,
        prefill_seconds=0.4,
        decode_seconds=1.0,
        rounds=tokens - 1,
        prefill_widths=[3],
    )


def _generation(items: list[UpstreamItem], fail_with: Exception | None = None) -> tuple[Generation, _Playback]:
    upstream = _Playback(items, fail_with)
    return Generation(_Backend(upstream), _request(), ReplyFormat(), "test-engine"), upstream  # type: ignore[arg-type]


def _framer(include_usage: bool = False) -> ChatFramer:
    return ChatFramer(ReplyMeta("chatcmpl-test", 1, "m", [1, 2, 3], include_usage=include_usage))


async def _sse(generation: Generation, framer: ChatFramer) -> list:
    await generation.start()
    raw = b"".join([part async for part in stream_body(generation, framer)]).decode()
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in raw.split("\n\n") if b]


def test_a_finished_reply_streams_deltas_then_finish_with_usage() -> None:
    items = [
        EngineChunk("chatcmpl-test", [7], "He"),
        EngineChunk("chatcmpl-test", [8, 9], "llo", FinishReason.STOP, stats=_stats(3)),
    ]
    generation, _ = _generation(items)
    events = asyncio.run(_sse(generation, _framer()))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["He", "llo"]
    assert events[3]["choices"][0]["finish_reason"] == "stop" and events[3]["usage"]["completion_tokens"] == 3
    assert events[3]["tensorfold"]["token_sha"] == token_sha([7, 8, 9])
    assert events[3]["tensorfold"]["tokens_per_second"] == 2.0  # 2 tokens after the first over 1 s
    assert events[3]["tensorfold"]["time_to_first_token"] == 0.5
    assert events[-1] == "[DONE]"


def test_an_engine_error_after_the_stream_opened_is_an_error_event_then_done(caplog) -> None:
    items = [
        EngineChunk("chatcmpl-test", [7], "He"),
        EngineChunk("chatcmpl-test", [], "", FinishReason.ERROR, error="boom"),
    ]
    generation, _ = _generation(items)
    with caplog.at_level(logging.INFO, logger="tensorfold.requests"):
        events = asyncio.run(_sse(generation, _framer()))
    assert events[-2] == {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"
    assert any(r.getMessage().startswith("ended chatcmpl-test reason=error: boom") for r in caplog.records)


def test_a_stream_that_dies_is_an_error_event_and_a_json_reply_a_500() -> None:
    generation, _ = _generation([EngineChunk("chatcmpl-test", [7], "He")], fail_with=RuntimeError("replica died"))
    events = asyncio.run(_sse(generation, _framer()))
    assert events[-2]["error"]["type"] == "server_error" and "replica died" in events[-2]["error"]["message"]

    async def whole() -> None:
        generation, _ = _generation([EngineChunk("chatcmpl-test", [7], "He")], fail_with=RuntimeError("gone"))
        await generation.start()
        await json_body_of(generation, _framer())

    with pytest.raises(GenerationFailed, match="gone"):
        asyncio.run(whole())


def test_refusals_and_early_failures_raise_before_any_stream() -> None:
    async def start(items: list, fail_with: Exception | None = None) -> None:
        generation, _ = _generation(items, fail_with)
        await generation.start()

    with pytest.raises(APIError) as info:
        asyncio.run(start([reply_past_window(window=8, prompt_tokens=3, reply_limit=10, param="messages")]))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert info.value.param == "messages" and info.value.message.startswith("This server's maximum context")
    with pytest.raises(APIError) as info:
        asyncio.run(start([], fail_with=RuntimeError("no replica")))
    assert info.value.status == 500 and info.value.type == "server_error"
    with pytest.raises(APIError) as info:  # an engine error before any token: still a plain 500
        asyncio.run(start([EngineChunk("chatcmpl-test", finish_reason=FinishReason.ERROR, error="bad step")]))
    assert info.value.status == 500 and "bad step" in info.value.message


def test_a_consumer_that_leaves_closes_upstream_and_logs_client_left(caplog) -> None:
    async def leave_after_first() -> _Playback:
        generation, upstream = _generation(
            [EngineChunk("chatcmpl-test", [7], "He"), EngineChunk("chatcmpl-test", [8], "y")]
        )
        await generation.start()
        chunks = generation.chunks()
        await anext(chunks)
        await chunks.aclose()
        return upstream

    with caplog.at_level(logging.INFO, logger="tensorfold.requests"):
        upstream = asyncio.run(leave_after_first())
    assert upstream.closed
    assert any("ended chatcmpl-test reason=client-left prompt=3 tokens=1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("ids", "reply", "expected"),
    [
        ([5, 6, 7], ReplyFormat(think_opener_id=1, think_closer_id=2), 0),
        ([1, 5, 2, 6], ReplyFormat(think_opener_id=1, think_closer_id=2), 3),
        ([5, 2, 6, 7], ReplyFormat(think_opener_id=1, think_closer_id=2, prompt_opens_thinking=True), 2),
        ([5, 6], ReplyFormat(think_opener_id=1, think_closer_id=2, prompt_opens_thinking=True), 2),
        ([1, 5], ReplyFormat(), 0),
    ],
)
def test_reasoning_tokens_count_through_the_closer(ids: list[int], reply: ReplyFormat, expected: int) -> None:
    assert reasoning_tokens(ids, reply) == expected


def _status(name: str, running: int, waiting: int, decode: float, requests: int) -> ReplicaStatus:
    counters = EngineCounters(requests_total=requests, prompt_tokens_total=10 * requests)
    return ReplicaStatus(
        replica=name,
        window=4096,
        lanes=8,
        policy="p",
        block_size=16,
        num_blocks=64,
        kv_usage=0.1,
        running=running,
        waiting=waiting,
        decode_tokens_per_second=decode,
        prefill_tokens_per_second=0.0,
        dtype="float32",
        device="cpu",
        device_name="cpu",
        model_type="glm4_moe",
        counters=counters,
    )


def test_health_sums_replicas_in_their_documented_order() -> None:
    body = health_body(
        IngressSettings(served_name="m", model_ids=["m", "a"], version="1.2.3"),
        [_status("r1", 2, 1, 10.04, 3), _status("r2", 1, 0, 5.0, 4)],
    )
    assert list(body)[:10] == [
        "status",
        "model",
        "model_ids",
        "max_batch_size",
        "vision",
        "policy",
        "warming",
        "memory",
        "live",
        "version",
    ]
    assert body["max_batch_size"] == 16 and body["memory"] == {}
    assert body["live"] == {
        "connections": 4,
        "waiting": 1,
        "decode_tokens_per_second": 15.0,
        "prefill_tokens_per_second": 0.0,
    }
    assert body["requests_total"] == 7 and body["prompt_tokens_total"] == 70 and body["replicas"] == 2
    assert "backend" not in body and "device" not in body
