"""Runs an Engine on its own thread and streams each request's chunks to asyncio callers.

Request coroutines and the engine thread exchange through a locked inbox (adds, aborts) and per-request
asyncio queues filled with `call_soon_threadsafe`, so the replica's event loop stays free. A caller's
iterator yields every chunk ready since its last yield, merged into one.
"""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from deployments.scheduler.engine import Engine, EngineInfo
from deployments.types import EngineChunk, EngineRequest, FinishReason

log = logging.getLogger("tensorfold.engine")


@dataclass
class _Subscriber:
    queue: asyncio.Queue  # of EngineChunk
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopping = False
        self._info = engine.info()
        self._thread = threading.Thread(target=self._run, name="tensorfold-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def info(self) -> EngineInfo:
        """The snapshot taken after the latest step (the engine's own state is the thread's)."""
        return self._info

    # ---- caller side ----------------------------------------------------------------------------------
    def stream_interval(self) -> float:
        """Seconds a reply's next chunk waits after its last: the configured floor, stretched so that all
        running streams together send at most `stream_events_per_second` chunks."""
        config = self.engine.config
        floor = config.stream_interval_ms / 1e3
        if config.stream_events_per_second <= 0:
            return floor
        return max(floor, len(self._subscribers) / config.stream_events_per_second)

    async def generate(self, request: EngineRequest, interval_s: float | None = None) -> AsyncIterator[EngineChunk]:
        """The request's chunks; after the first, at most one per interval (default: `stream_interval()`,
        read after each chunk); the last is never held."""
        self.engine.validate(request)  # refusals come before the first chunk
        subscriber = _Subscriber(asyncio.Queue(), asyncio.get_running_loop())
        with self._wake:
            if request.request_id in self._subscribers:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._subscribers[request.request_id] = subscriber
            self._adds.append(request)
            self._wake.notify()
        finished = False
        next_at: float | None = None  # when the next chunk may leave (None: at once)
        try:
            while not finished:
                chunk: EngineChunk = await subscriber.queue.get()
                if next_at is not None and not chunk.finished:
                    await _collect_until(subscriber.queue, chunk, next_at)
                while not subscriber.queue.empty() and not chunk.finished:
                    chunk.merge(subscriber.queue.get_nowait())
                finished = chunk.finished
                yield chunk
                wait = self.stream_interval() if interval_s is None else interval_s
                if wait > 0:
                    next_at = asyncio.get_running_loop().time() + wait
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._adds and not self._aborts and not self.engine.has_work():
                    self._wake.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            try:
                for request in adds:
                    self._add(request)
                for request_id in aborts:
                    self.engine.abort_request(request_id)
                self._deliver(self.engine.step())
            except Exception:  # a bug in the loop body: end what is in flight rather than hang it
                log.exception("engine step failed; ending every request in flight")
                self.engine.abort_all()
                self._fail_all("internal engine error")
            self._info = self.engine.info()
        self._fail_all("the server is shutting down")

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # validated already; anything here is a server fault for this request only
            log.exception("could not add request %s", request.request_id)
            self._deliver([EngineChunk(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc))])

    def _deliver(self, chunks: list[EngineChunk]) -> None:
        for chunk in chunks:
            with self._lock:
                subscriber = (
                    self._subscribers.pop(chunk.request_id, None)
                    if chunk.finished
                    else self._subscribers.get(chunk.request_id)
                )
            if subscriber is not None:
                subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, chunk)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending = list(self._subscribers.items())
            self._subscribers.clear()
        for request_id, subscriber in pending:
            chunk = EngineChunk(request_id, finish_reason=FinishReason.ERROR, error=message)
            subscriber.loop.call_soon_threadsafe(subscriber.queue.put_nowait, chunk)


async def _collect_until(queue: "asyncio.Queue[EngineChunk]", chunk: EngineChunk, deadline: float) -> None:
    """Merge later chunks into `chunk` until the deadline, or at once when the reply finishes."""
    loop = asyncio.get_running_loop()
    while not chunk.finished:
        remaining = deadline - loop.time()
        if remaining <= 0:
            return
        try:
            chunk.merge(await asyncio.wait_for(queue.get(), remaining))
        except TimeoutError:
            return
