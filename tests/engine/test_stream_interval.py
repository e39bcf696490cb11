"""`stream_interval_ms`: a reply's chunks leave the engine loop at most once per interval (the first and the
last at once), carrying exactly the tokens and text an unpaced stream carries. And a request's checks (a
grammar's compile among them) never hold the event loop the streams are delivered on."""

import asyncio
import threading
import time

import pytest

from deployments.chat_format.rendering import PromptRenderer
from deployments.config import EngineConfig
from deployments.messages.engine_process import Inbox
from deployments.messages.render import ChatRenderRequest
from deployments.messages.replies import EngineChunk, FinishReason
from deployments.messages.requests import EngineRequest, SamplingParams
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.hub import StreamHub
from deployments.scheduler.transports.thread import EngineLoop
from serve_app.args import AppArgs

INTERVAL_S = 0.05
HELD_S = 1.0  # long beside a few loop turns, however loaded the machine


@pytest.fixture(scope="module")
def loop_and_prompt(served_model: str):
    model_dir = AppArgs(model=served_model).model_dir
    loop = EngineLoop(Engine(EngineConfig(model=str(model_dir), context=256, kv_cache_gib=0.05, device="cpu")))
    loop.start()
    prompt = PromptRenderer.from_checkpoint(model_dir).render_chat(
        ChatRenderRequest(
            [{"role": "user", "content": "Count from 1 to 20."}], chat_template_kwargs={"enable_thinking": False}
        )
    )
    yield loop, prompt.prompt_token_ids
    loop.shutdown()


def _collect(loop: EngineLoop, prompt: list[int], tag: str, interval_s: float) -> list[tuple[float, EngineChunk]]:
    async def run() -> list[tuple[float, EngineChunk]]:
        request = EngineRequest(tag, prompt, SamplingParams(temperature=0.0), max_tokens=60)
        return [(time.monotonic(), chunk) async for chunk in loop.generate(request, interval_s)]

    return asyncio.run(run())


def test_paced_chunks_carry_the_same_reply(loop_and_prompt) -> None:
    loop, prompt = loop_and_prompt
    unpaced = [chunk for _, chunk in _collect(loop, prompt, "unpaced", 0.0)]
    paced = _collect(loop, prompt, "paced", INTERVAL_S)
    chunks = [chunk for _, chunk in paced]
    assert [t for c in chunks for t in c.token_ids] == [t for c in unpaced for t in c.token_ids]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in unpaced)
    assert chunks[-1].finished and chunks[-1].stats is not None
    arrivals = [at for at, _ in paced]
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:-1])]  # the last is never held
    assert all(gap >= INTERVAL_S * 0.9 for gap in gaps), gaps
    assert len(chunks) <= len(unpaced)


def test_the_events_cap_stretches_each_streams_interval_with_the_number_of_streams(served_model: str) -> None:
    """Two streams under a cap of 20 chunks/s together: each waits at least 2 / 20 s between chunks."""
    model_dir = AppArgs(model=served_model).model_dir
    config = EngineConfig(
        model=str(model_dir), context=512, kv_cache_gib=0.05, device="cpu", stream_events_per_second=20.0
    )
    loop = EngineLoop(Engine(config))
    loop.start()
    prompt = (
        PromptRenderer.from_checkpoint(model_dir)
        .render_chat(
            ChatRenderRequest(
                [{"role": "user", "content": "Count from 1 to 20."}], chat_template_kwargs={"enable_thinking": False}
            )
        )
        .prompt_token_ids
    )
    assert loop.stream_interval() == 0.0  # no stream running: nothing to pace

    async def stream(tag: str) -> list[float]:
        # Both streams run the same 200 steps (no early end), several intervals however fast the engine is.
        request = EngineRequest(tag, prompt, SamplingParams(temperature=0.0, ignore_eos=True), max_tokens=200)
        return [time.monotonic() async for chunk in loop.generate(request) if not chunk.finished]

    async def both() -> list[list[float]]:
        return list(await asyncio.gather(stream("a"), stream("b")))

    try:
        runs = asyncio.run(both())
    finally:
        loop.shutdown()
    for arrivals in runs:  # while both run, each stream's interval is 2 / 20 s
        gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]
        assert gaps and all(gap >= 0.09 for gap in gaps), gaps


class _HandFedHub(StreamHub):
    """A hub whose engine is the test: it delivers each chunk itself."""

    def _send(self, inbox: Inbox) -> None:
        pass


async def _settle() -> None:
    for _ in range(10):  # enough loop turns for a threadsafe hand-over to wake its taker; no timer fires
        await asyncio.sleep(0)


def test_the_first_and_last_chunks_leave_at_once_and_the_rest_wait_out_the_interval() -> None:
    """Pacing itself, free of engine timing (a consumer slower than a step may merge the first two tokens)."""

    async def run() -> None:
        hub = _HandFedHub(EngineConfig(model="unused"))
        loop = asyncio.get_running_loop()
        stream = hub.generate(EngineRequest("r", [1, 2], SamplingParams(), max_tokens=3), HELD_S)
        first = asyncio.ensure_future(anext(stream))
        await _settle()  # registered and submitted
        hub.deliver_chunks([EngineChunk("r", token_ids=[5])])
        await _settle()
        assert first.done() and first.result().token_ids == [5]
        taken_at = loop.time()
        second = asyncio.ensure_future(anext(stream))
        hub.deliver_chunks([EngineChunk("r", token_ids=[6])])
        hub.deliver_chunks([EngineChunk("r", token_ids=[7])])
        await _settle()
        assert not second.done()  # held by the interval, gathering what arrives meanwhile
        assert (await second).token_ids == [6, 7] and loop.time() - taken_at >= HELD_S
        last = asyncio.ensure_future(anext(stream))
        hub.deliver_chunks([EngineChunk("r", token_ids=[8], finish_reason=FinishReason.LENGTH)])
        await _settle()
        assert last.done() and last.result().finished  # the last is never held
        await stream.aclose()

    asyncio.run(run())


def test_a_requests_checks_leave_the_event_loop_free(loop_and_prompt, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check waits for the event loop to run a callback: were it on the loop, it would wait in vain."""
    loop, prompt = loop_and_prompt
    released = threading.Event()
    check = loop.engine.check

    def slow_check(request: EngineRequest):  # as a large grammar's first compile
        assert released.wait(timeout=10), "the request's check held the event loop"
        return check(request)

    monkeypatch.setattr(loop.engine, "check", slow_check)

    async def run() -> list[EngineChunk]:
        asyncio.get_running_loop().call_soon(released.set)
        request = EngineRequest("checked", prompt, SamplingParams(temperature=0.0), max_tokens=4)
        return [chunk async for chunk in loop.generate(request, 0.0)]

    chunks = asyncio.run(run())
    assert released.is_set() and chunks[-1].finished
