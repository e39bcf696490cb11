"""The engine in its own process (EngineProcess): the same replies, refusals and bookkeeping as the engine on
a thread of this process, and a child that dies ends what is in flight instead of hanging it."""

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.messages.engine_process import ForgetDisk, Imprint
from deployments.messages.replies import EngineChunk, FinishReason, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.store import ReadStats
from deployments.prompt_store.links import LocalStoreLink
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.hub import StreamHub
from deployments.scheduler.transports.process import EngineProcess
from deployments.scheduler.transports.thread import EngineLoop
from serve_app.args import AppArgs
from tests.support.requests import greedy, sampled

PROMPTS = [[11, 12, 13, 14], [200, 201, 202], [5] * 40, [300, 301, 302, 303, 304, 305]]


def _config(served_model: str) -> EngineConfig:
    model_dir = str(AppArgs(model=served_model).model_dir)
    return EngineConfig(model=model_dir, context=256, kv_cache_gib=0.05, device="cpu", engine_process=True)


@pytest.fixture(scope="module")
def process(served_model: str) -> Iterator[EngineProcess]:
    driver = EngineProcess(_config(served_model))
    driver.start()
    yield driver
    driver.shutdown()


@pytest.fixture(scope="module")
def thread(served_model: str) -> Iterator[EngineLoop]:
    driver = EngineLoop(Engine(_config(served_model)))
    driver.start()
    yield driver
    driver.shutdown()


def _request(tag: str, prompt: list[int], seed: int | None = None, max_tokens: int = 24) -> EngineRequest:
    return greedy(tag, prompt, max_tokens) if seed is None else sampled(tag, prompt, seed, max_tokens=max_tokens)


async def _reply(driver: StreamHub, request: EngineRequest) -> list[EngineChunk | Refusal]:
    return [item async for item in driver.generate(request)]


def _replies(driver: StreamHub, tag: str) -> list[tuple[list[int], str, FinishReason | None]]:
    async def run() -> list[list[EngineChunk]]:
        requests = [_request(f"{tag}-{i}", p) for i, p in enumerate(PROMPTS)]
        requests.append(_request(f"{tag}-seeded", PROMPTS[0], seed=7))
        return list(await asyncio.gather(*[_reply(driver, r) for r in requests]))

    return [
        ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].finish_reason)
        for chunks in asyncio.run(run())
    ]


def test_replies_equal_the_engine_on_a_thread(process: EngineProcess, thread: EngineLoop) -> None:
    from_process, from_thread = _replies(process, "p"), _replies(thread, "t")
    assert from_process == from_thread
    assert all(tokens and finish in (FinishReason.STOP, FinishReason.LENGTH) for tokens, _, finish in from_process)


def _refusal(driver: StreamHub, request: EngineRequest) -> Refusal:
    (only,) = asyncio.run(_reply(driver, request))  # a refusal is the stream's only item
    assert isinstance(only, Refusal)
    return only


@pytest.mark.parametrize("prompt, max_tokens", [([7] * 300, 4), ([7] * 200, 100), ([10**6], 4), ([], 4)])
def test_refusals_are_the_ones_the_engine_on_a_thread_gives(
    process: EngineProcess, thread: EngineLoop, prompt: list[int], max_tokens: int
) -> None:
    from_process = _refusal(process, _request("refused", prompt, max_tokens=max_tokens))
    from_thread = _refusal(thread, _request("refused", prompt, max_tokens=max_tokens))
    assert from_process == from_thread  # message, param, code, status and type
    assert from_process.param == "messages" and from_process.status == 400
    context = prompt == [7] * 300 or max_tokens == 100
    assert (from_process.code == "context_length_exceeded") == context
    assert process.alive()


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_stream_closed_early_aborts_its_request_and_frees_its_blocks(process: EngineProcess) -> None:
    aborted_before = process.info().counters.requests_aborted_total

    async def leave_after_first_chunk() -> None:
        stream = process.generate(_request("leaves", PROMPTS[2], max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()

    asyncio.run(leave_after_first_chunk())
    _wait_until(lambda: process.info().counters.requests_aborted_total == aborted_before + 1)
    assert process.info().running == 0 and process.info().kv_usage == 0.0


def test_memory_and_info_are_the_childs(process: EngineProcess) -> None:
    memory = asyncio.run(process.memory())
    info = process.info()
    assert memory.kv_blocks_total == info.num_blocks > 0
    assert memory.process_rss_bytes > 0 and memory.ranks[0].weights_bytes > 0
    # a CPU engine reports no device memory, only the child's footprint (its resident set, not this process's)
    figures = process.memory_figures()
    assert set(figures) == {"footprint"} and figures["footprint"] > 0


def test_a_dead_engine_process_ends_its_requests_and_fails_the_health_check(served_model: str) -> None:
    lost: list[str] = []
    driver = EngineProcess(_config(served_model), on_lost=lost.append)
    driver.start()

    async def run() -> EngineChunk:
        chunks = []
        async for chunk in driver.generate(_request("orphan", PROMPTS[2], max_tokens=200)):
            chunks.append(chunk)
            if len(chunks) == 1:
                driver._process.kill()  # the engine dies mid-reply
        return chunks[-1]

    try:
        last = asyncio.run(asyncio.wait_for(run(), 30))
        assert last.finish_reason == FinishReason.ERROR and "engine process exited" in (last.error or "")
        _wait_until(lambda: bool(lost))  # called once the requests have ended
        assert not driver.alive() and lost == [driver.lost] == ["the engine process exited"]
        with pytest.raises(RuntimeError, match="engine process has exited"):
            asyncio.run(_reply(driver, _request("after", PROMPTS[0])))
        assert not driver._subscribers  # a request that could not be sent leaves no mailbox behind
    finally:
        driver.shutdown()


def test_end_all_ends_every_stream_with_the_reason_and_drops_the_requests(process: EngineProcess) -> None:
    aborted_before = process.info().counters.requests_aborted_total

    async def run() -> tuple[list[EngineChunk | Refusal], list[EngineChunk | Refusal]]:
        requests = [greedy(f"ended-{i}", PROMPTS[2], 200, to_limit=True) for i in range(2)]
        streams = [process.generate(request) for request in requests]
        firsts = [await anext(stream) for stream in streams]  # both are running
        assert process.end_all("the server is shutting down") == 2
        rests = [[item async for item in stream] for stream in streams]
        return [firsts[0], *rests[0]], [firsts[1], *rests[1]]

    for items in asyncio.run(asyncio.wait_for(run(), 30)):
        last = items[-1]
        assert isinstance(last, EngineChunk) and last.finish_reason == FinishReason.ERROR
        assert last.error == "the server is shutting down"
    _wait_until(lambda: process.info().counters.requests_aborted_total == aborted_before + 2)
    assert process.info().running == 0 and process.alive()


def test_a_call_the_engine_does_not_know_is_refused_and_the_engine_goes_on(process: EngineProcess) -> None:
    with pytest.raises(RuntimeError, match="TypeError: not an engine call: ReadStats"):
        asyncio.run(process.ask(ReadStats("s")))  # a store call is no engine call
    assert asyncio.run(process.memory()).kv_blocks_total > 0 and process.alive()


def test_the_childs_store_calls_are_relayed_to_the_replicas_link(served_model: str, tmp_path: Path) -> None:
    """The engine in its process reaches the node's store through the replica (store_relay.py): the
    conversation it kept is written, the imprint routes find it on disk, and forgetting deletes it."""
    store = tmp_path / "store"
    config = _config(served_model).model_copy(update={"learn_dir": str(store), "learn_conversations": True})
    driver = EngineProcess(config, LocalStoreLink(config))
    driver.start()
    prompt = [(13 * i) % 600 + 30 for i in range(80)]
    try:
        chunks = asyncio.run(_reply(driver, _request("kept", prompt)))
        reply = [t for chunk in chunks if isinstance(chunk, EngineChunk) for t in chunk.token_ids]
        _wait_until(lambda: any(store.rglob("*.piece")))  # written while the engine idles, relayed
        answer = asyncio.run(driver.ask(Imprint(ImprintQuery(prompt + reply + [40, 41]))))
        assert answer.disk and answer.disk_tokens >= len(prompt) // 16 * 16
        freed = asyncio.run(driver.ask(ForgetDisk()))
        assert isinstance(freed, int) and freed > 0 and not any(store.rglob("*.piece"))
    finally:
        driver.shutdown()


def test_an_engine_that_cannot_start_fails_the_constructor(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="the engine process did not start"):
        EngineProcess(EngineConfig(model=str(tmp_path), device="cpu", engine_process=True))
