"""The caller side of a running engine: per-request mailboxes on asyncio loops, fed once per engine step.

An engine driver (EngineLoop: a thread in this process; EngineProcess: a child process) registers each
request here and hands every step's chunks to `deliver`, from any thread. `deliver` groups them by the
caller's event loop and posts one `call_soon_threadsafe` per loop, so a step costs a loop one wake-up
however many streams it feeds. A caller's iterator yields every chunk ready since its last yield, merged
into one; pacing holds the next one with a timer, not a task per chunk.
"""

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from deployments.config import EngineConfig
from deployments.messages.replies import EngineChunk, FinishReason
from deployments.messages.requests import EngineRequest

log = logging.getLogger("tensorfold.engine")
Delivery = EngineChunk | Exception  # an exception: the request was refused before its first chunk


class _Subscriber:
    """One request's mailbox on its caller's event loop; touched only on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: EngineChunk | None = None  # chunks not yet taken, merged into one
        self.release_at = 0.0  # loop time before which a non-final chunk is held (pacing)
        self._waiter: asyncio.Future[None] | None = None  # set while the caller waits
        self._timer: asyncio.TimerHandle | None = None
        self.refusal: Exception | None = None  # raised by take() in place of a chunk

    def offer(self, item: Delivery) -> None:
        if isinstance(item, Exception):
            self.refusal = item
            self.pending = EngineChunk("", finish_reason=FinishReason.ERROR)  # wakes the caller at once
        elif self.pending is None:
            self.pending = item
        else:
            self.pending.merge(item)
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
        if self.refusal is not None:
            raise self.refusal
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


def _hand_over(items: list[tuple[_Subscriber, Delivery]]) -> None:
    """On a caller loop: one step's chunks for the subscribers that live there."""
    for subscriber, item in items:
        subscriber.offer(item)


class StreamHub(ABC):
    """Subscribers by request id; a driver subclass implements `_submit` and `_cancel` for its engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._subscribers: dict[str, _Subscriber] = {}

    @abstractmethod
    def _submit(self, request: EngineRequest) -> None:
        """Send the request to the engine (its subscriber is registered already)."""

    @abstractmethod
    def _cancel(self, request_id: str) -> None:
        """Ask the engine to drop the request at its next step."""

    def _check(self, request: EngineRequest) -> None:
        """Refusals the driver can raise before the request is sent (default: the engine sends them)."""

    def stream_interval(self) -> float:
        """Seconds a reply's next chunk waits after its last: the configured floor, stretched so that all
        running streams together send at most `stream_events_per_second` chunks."""
        floor = self.config.stream_interval_ms / 1e3
        if self.config.stream_events_per_second <= 0:
            return floor
        return max(floor, len(self._subscribers) / self.config.stream_events_per_second)

    async def generate(self, request: EngineRequest, interval_s: float | None = None) -> AsyncIterator[EngineChunk]:
        """The request's chunks; after the first, at most one per interval (default: `stream_interval()`,
        read after each chunk); the last is never held. Refusals raise before the first chunk."""
        self._check(request)
        subscriber = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._subscribers:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self._subscribers[request.request_id] = subscriber
        finished = False
        try:
            self._submit(request)
            while not finished:
                chunk = await subscriber.take()
                finished = chunk.finished
                yield chunk
                wait = self.stream_interval() if interval_s is None else interval_s
                subscriber.release_at = subscriber.loop.time() + wait
        finally:  # (aborting a refused request is a no-op: the engine never took it)
            subscriber.close()
            if not finished:
                with self._lock:  # nobody listens any more, whether or not the engine answers the abort
                    if self._subscribers.get(request.request_id) is subscriber:
                        del self._subscribers[request.request_id]
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._cancel(request_id)

    def deliver(self, items: list[tuple[str, Delivery]]) -> None:
        """From any thread: one hand-over per caller loop (a finished or refused request leaves the table)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Subscriber, Delivery]]] = {}
        with self._lock:
            for request_id, item in items:
                last = isinstance(item, Exception) or item.finished
                subscriber = self._subscribers.pop(request_id, None) if last else self._subscribers.get(request_id)
                if subscriber is not None:
                    by_loop.setdefault(subscriber.loop, []).append((subscriber, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_hand_over, batch)
            except RuntimeError:  # that loop has closed: its callers are gone
                log.debug("dropped %d chunks for a closed event loop", len(batch))

    def deliver_chunks(self, chunks: list[EngineChunk]) -> None:
        self.deliver([(chunk.request_id, chunk) for chunk in chunks])

    def fail_all(self, message: str) -> None:
        with self._lock:
            pending = list(self._subscribers)
        self.deliver_chunks([EngineChunk(rid, finish_reason=FinishReason.ERROR, error=message) for rid in pending])
