"""Runs an Engine on its own thread and streams each request's chunks to asyncio callers.

Request coroutines and the engine thread exchange through a locked inbox (adds, aborts); after each step
the engine thread hands that step's chunks to each caller event loop in one `call_soon_threadsafe`, so
a step costs the loop one wake-up however many streams it feeds. A caller's iterator yields every chunk
ready since its last yield, merged into one; pacing holds the next one with a timer, not a task per chunk.
"""

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from deployments.scheduler.engine import Engine, EngineInfo
from deployments.types import EngineChunk, EngineRequest, FinishReason

log = logging.getLogger("tensorfold.engine")


class _Subscriber:
    """One request's mailbox on its caller's event loop; touched only on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: EngineChunk | None = None  # chunks not yet taken, merged into one
        self.release_at = 0.0  # loop time before which a non-final chunk is held (pacing)
        self._waiter: asyncio.Future[None] | None = None  # set while the caller waits
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, chunk: EngineChunk) -> None:
        if self.pending is None:
            self.pending = chunk
        else:
            self.pending.merge(chunk)
        self._wake_if_ready()

    async def take(self) -> EngineChunk:
        """The merged pending chunk, once there is one and its release time has come (a last chunk: at once)."""
        while not self._ready():
            self._waiter = self.loop.create_future()
            self._wake_if_ready()  # pending but held: arms the timer
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk, self.pending = self.pending, None
        assert chunk is not None
        return chunk

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ready(self) -> bool:
        return self.pending is not None and (self.pending.finished or self.loop.time() >= self.release_at)

    def _wake_if_ready(self) -> None:
        if self._waiter is None or self._waiter.done() or self.pending is None:
            return
        if self._ready():
            self._waiter.set_result(None)
        elif self._timer is None:
            self._timer = self.loop.call_at(self.release_at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake_if_ready()


def _hand_over(items: list[tuple[_Subscriber, EngineChunk]]) -> None:
    """On a caller loop: one step's chunks for the subscribers that live there."""
    for subscriber, chunk in items:
        subscriber.offer(chunk)


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
        subscriber = _Subscriber(asyncio.get_running_loop())
        with self._wake:
            if request.request_id in self._subscribers:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._subscribers[request.request_id] = subscriber
            self._adds.append(request)
            self._wake.notify()
        finished = False
        try:
            while not finished:
                chunk = await subscriber.take()
                finished = chunk.finished
                yield chunk
                wait = self.stream_interval() if interval_s is None else interval_s
                subscriber.release_at = subscriber.loop.time() + wait
        finally:
            subscriber.close()
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
        """One hand-over per caller loop for the whole step (a finished request leaves the table here)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Subscriber, EngineChunk]]] = {}
        with self._lock:
            for chunk in chunks:
                subscriber = (
                    self._subscribers.pop(chunk.request_id, None)
                    if chunk.finished
                    else self._subscribers.get(chunk.request_id)
                )
                if subscriber is not None:
                    by_loop.setdefault(subscriber.loop, []).append((subscriber, chunk))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, items)
            except RuntimeError:  # that loop has closed: its callers are gone
                log.debug("dropped %d chunks for a closed event loop", len(items))

    def _fail_all(self, message: str) -> None:
        with self._lock:
            pending = list(self._subscribers)
        self._deliver([EngineChunk(rid, finish_reason=FinishReason.ERROR, error=message) for rid in pending])
