"""The caller side of a running engine: per-request mailboxes on asyncio loops, fed once per engine turn.

A transport (EngineLoop: a thread in this process; EngineProcess: a child process) sends each request,
abort and call to its engine as an `Inbox`, and hands each turn's `Stepped` to `on_stepped`, from any
thread. Its chunks and refusals go through `deliver`, which groups them by the caller's event loop and
posts one `call_soon_threadsafe` per loop, so a step costs a loop one wake-up however many streams it
feeds. A caller's iterator yields every chunk ready since its last yield, merged into one; pacing holds
the next one with a timer, not a task per chunk. A refused request yields its `Refusal` as its only item.
"""

import asyncio
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from deployments.config import EngineConfig
from deployments.messages.calls import Reply
from deployments.messages.engine_process import CallAnswer, CallEnvelope, EngineCall, Inbox, MemorySnapshot, Stepped
from deployments.messages.memory import ReplicaMemory
from deployments.messages.prefix import PrefixDigest
from deployments.messages.replies import EngineChunk, FinishReason, Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.status import EngineInfo, UpstreamItem

log = logging.getLogger("tensorfold.engine")
MEMORY_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 120.0  # an imprint load reads a whole conversation from disk


class _Subscriber:
    """One request's mailbox on its caller's event loop; touched only on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: EngineChunk | None = None  # chunks not yet taken, merged into one
        self.release_at = 0.0  # loop time before which a non-final chunk is held (pacing)
        self._waiter: asyncio.Future[None] | None = None  # set while the caller waits
        self._timer: asyncio.TimerHandle | None = None
        self.refusal: Refusal | None = None  # taken in place of any chunk: the request never ran

    def offer(self, item: UpstreamItem) -> None:
        if isinstance(item, Refusal):
            self.refusal = item
        elif self.pending is None:
            self.pending = item
        else:
            self.pending.merge(item)
        self._wake_if_ready()

    async def take(self) -> UpstreamItem:
        """The merged pending chunk, once there is one and its release time has come (a last chunk or a
        refusal: at once)."""
        while not self._ready():
            self._waiter = self.loop.create_future()
            self._wake_if_ready()  # pending but held: arms the timer
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.refusal is not None:
            return self.refusal
        chunk, self.pending = self.pending, None
        assert chunk is not None
        return chunk

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ready(self) -> bool:
        if self.refusal is not None:
            return True
        return self.pending is not None and (self.pending.finished or self.loop.time() >= self.release_at)

    def _wake_if_ready(self) -> None:
        if self._waiter is None or self._waiter.done() or (self.pending is None and self.refusal is None):
            return
        if self._ready():
            self._waiter.set_result(None)
        elif self._timer is None:
            self._timer = self.loop.call_at(self.release_at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wake_if_ready()


def _hand_over(items: list[tuple[_Subscriber, UpstreamItem]]) -> None:
    """On a caller loop: one step's chunks for the subscribers that live there."""
    for subscriber, item in items:
        subscriber.offer(item)


class StreamHub(ABC):
    """Subscribers by request id, and the engine's latest snapshots; a transport implements `_send`."""

    def __init__(
        self, config: EngineConfig, info: EngineInfo | None = None, memory_figures: dict[str, int] | None = None
    ) -> None:
        """`info`, `memory_figures`: the engine's first snapshot (the later ones come with its turns)."""
        self.config = config
        self._lock = threading.Lock()
        self._subscribers: dict[str, _Subscriber] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # waiting for answers
        self._call_ids = itertools.count()
        self._info = info
        self._memory_figures = memory_figures or {}
        self._digest = PrefixDigest(config.block_size, b"")

    @abstractmethod
    def _send(self, inbox: Inbox) -> None:
        """Hand the engine requests, aborts or calls for its next turn (from any thread)."""

    def _submit(self, request: EngineRequest) -> None:
        """Send the request to the engine (its subscriber is registered already)."""
        self._send(Inbox(adds=[request]))

    def _cancel(self, request_id: str) -> None:
        """Ask the engine to drop the request at its next turn."""
        self._send(Inbox(aborts=[request_id]))

    def _check(self, request: EngineRequest) -> Refusal | None:
        """A refusal the transport can tell before the request is sent (default: the engine sends them)."""
        return None

    # ---- the engine's snapshots -------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        """The snapshot taken after the engine's latest busy interval or idle turn (read on any thread)."""
        assert self._info is not None, "the engine has not reported yet"
        return self._info

    def memory_figures(self) -> dict[str, int]:
        """The engine process's device memory and footprint, taken with `info`."""
        return self._memory_figures

    def prefix_digest(self) -> PrefixDigest:
        """The latest digest of the blocks the engine holds (for the router)."""
        return self._digest

    async def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return await self.ask(MemorySnapshot(reset_peak), MEMORY_TIMEOUT_S)

    async def ask(self, call: EngineCall[Reply], timeout_s: float = CALL_TIMEOUT_S) -> Reply:
        """A typed engine call (messages/engine_process.py, messages/slide.py), answered by the engine between
        two steps; its failure is raised here as a RuntimeError."""
        loop = asyncio.get_running_loop()
        call_id = next(self._call_ids)
        future: asyncio.Future = loop.create_future()
        with self._lock:
            self._calls[call_id] = (loop, future)
        try:
            self._send(Inbox(calls=[CallEnvelope(call_id, call)]))
            return call.reply(await asyncio.wait_for(future, timeout_s))
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    # ---- requests -------------------------------------------------------------------------------------
    def stream_interval(self) -> float:
        """Seconds a reply's next chunk waits after its last: the configured floor, stretched so that all
        running streams together send at most `stream_events_per_second` chunks."""
        floor = self.config.stream_interval_ms / 1e3
        if self.config.stream_events_per_second <= 0:
            return floor
        return max(floor, len(self._subscribers) / self.config.stream_events_per_second)

    async def generate(self, request: EngineRequest, interval_s: float | None = None) -> AsyncIterator[UpstreamItem]:
        """The request's chunks; after the first, at most one per interval (default: `stream_interval()`,
        read after each chunk); the last is never held. A refused request yields its Refusal alone."""
        # Off the event loop: a grammar's first compile takes up to seconds, and the streams wait on this loop.
        refusal = await asyncio.to_thread(self._check, request)
        subscriber = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            if refusal is None and request.request_id in self._subscribers:
                refusal = Refusal(f"request id {request.request_id!r} is already running", request.prompt_param)
            if refusal is None:
                self._subscribers[request.request_id] = subscriber
        if refusal is not None:
            yield refusal
            return
        finished = False
        try:
            self._submit(request)
            while not finished:
                item = await subscriber.take()
                finished = isinstance(item, Refusal) or item.finished
                yield item
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

    def on_stepped(self, stepped: Stepped) -> None:
        """From the transport's thread: one turn of the engine (the snapshot first, so a caller that has its
        reply's last chunk finds the reply counted)."""
        if stepped.info is not None:
            self._info, self._memory_figures = stepped.info, stepped.memory_figures
        if stepped.digest is not None:
            self._digest = stepped.digest
        for answer in stepped.answers:
            self._answer(answer)
        items: list[tuple[str, UpstreamItem]] = list(stepped.refusals)
        items += [(chunk.request_id, chunk) for chunk in stepped.chunks]
        self.deliver(items)
        if stepped.failed is not None:
            self.fail_all(stepped.failed)

    def _answer(self, answer: CallAnswer) -> None:
        with self._lock:
            entry = self._calls.get(answer.call_id)
        if entry is not None:
            loop, future = entry
            error = None if answer.error is None else RuntimeError(answer.error)
            try:
                loop.call_soon_threadsafe(_settle, future, answer.value, error)
            except RuntimeError:  # that loop has closed: its caller is gone
                log.debug("dropped the answer to call %d for a closed event loop", answer.call_id)

    def deliver(self, items: list[tuple[str, UpstreamItem]]) -> None:
        """From any thread: one hand-over per caller loop (a finished or refused request leaves the table)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Subscriber, UpstreamItem]]] = {}
        with self._lock:
            for request_id, item in items:
                last = isinstance(item, Refusal) or item.finished
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

    def fail_all(self, message: str) -> list[str]:
        """End every stream in flight with `message` as its error; returns their request ids."""
        with self._lock:
            pending = list(self._subscribers)
        self.deliver_chunks([EngineChunk(rid, finish_reason=FinishReason.ERROR, error=message) for rid in pending])
        return pending

    def end_all(self, message: str) -> int:
        """A planned stop's last word: every request in flight ends with `message`, and the engine drops
        them (their streams are settled, so nothing else would abort them). Returns how many there were."""
        ended = self.fail_all(message)
        for request_id in ended:
            self.abort(request_id)
        return len(ended)


def _settle(future: asyncio.Future, value: object, error: BaseException | None) -> None:
    if future.done():  # (it timed out already)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
