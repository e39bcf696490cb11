"""Runs an Engine on a thread of this process (tests, benchmarks, tensor-parallel replicas).

Request coroutines and the engine thread exchange through a locked inbox (adds, aborts); after each step
the thread hands that step's chunks to the StreamHub, which wakes each caller loop once.
"""

import asyncio
import logging
import threading

from deployments.messages.memory import ReplicaMemory
from deployments.messages.prefix import PrefixDigest
from deployments.messages.replies import EngineChunk, FinishReason
from deployments.messages.requests import EngineRequest
from deployments.scheduler.engine.core import ENGINE_CALLS, Engine, EngineInfo
from deployments.scheduler.memory_report import memory_figures_of, replica_memory
from deployments.scheduler.transports.hub import StreamHub

log = logging.getLogger("tensorfold.engine")


class EngineLoop(StreamHub):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.config)
        self.engine = engine
        self._wake = threading.Condition(self._lock)
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[str, tuple, asyncio.AbstractEventLoop, asyncio.Future]] = []  # run between steps
        self._stopping = False
        self._info = engine.info()
        self._digest = PrefixDigest(engine.config.block_size, b"")
        self._thread = threading.Thread(target=self._run, name="tensorfold-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def info(self) -> EngineInfo:
        """The snapshot taken after the latest step (the engine's own state is the thread's)."""
        return self._info

    def memory_figures(self) -> dict[str, int]:
        return memory_figures_of(str(self._info.device))

    def prefix_digest(self) -> PrefixDigest:
        """The latest digest of the engine's blocks, taken on its thread (for the router)."""
        return self._digest

    async def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return replica_memory("", self.engine, reset_peak)

    async def engine_call(self, name: str, *args: object) -> object:
        """One of ENGINE_CALLS, run on the engine's thread between steps."""
        assert name in ENGINE_CALLS, name
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._wake:
            self._calls.append((name, args, loop, future))
            self._wake.notify()
        return await future

    # ---- caller side ----------------------------------------------------------------------------------
    def _check(self, request: EngineRequest) -> None:
        self.engine.validate(request)  # on the caller's thread, so a refusal never waits for a step

    def _submit(self, request: EngineRequest) -> None:
        with self._wake:
            self._adds.append(request)
            self._wake.notify()

    def _cancel(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._adds or self._aborts or self._calls or self.engine.has_work()):
                    if self.engine.has_idle_work():
                        break
                    self._wake.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
            for name, args, loop, future in calls:
                _run_call(self.engine, name, args, loop, future)
            if not adds and not aborts and not calls and not self.engine.has_work():
                self.engine.idle_work()  # one piece to disk; a request arriving meanwhile waits for it alone
                continue
            failed = False
            try:
                for request in adds:
                    self._add(request)
                for request_id in aborts:
                    self.engine.abort_request(request_id)
                chunks = self.engine.step()
            except Exception:  # a bug in the loop body: end what is in flight rather than hang it
                log.exception("engine step failed; ending every request in flight")
                self.engine.abort_all()
                chunks, failed = [], True
            # The snapshot first: a caller that has its reply's last chunk finds the reply counted.
            self._info = self.engine.info()
            self._digest = self.engine.fresh_digest(force=not self.engine.has_work()) or self._digest
            self.deliver_chunks(chunks)
            if failed:
                self.fail_all("internal engine error")
        self.engine.finish_writes()  # a planned stop writes what is waiting, and waits for the store to have it
        self.fail_all("the server is shutting down")

    def _add(self, request: EngineRequest) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # validated already; anything here is a server fault for this request only
            log.exception("could not add request %s", request.request_id)
            self.deliver_chunks([EngineChunk(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc))])


def _run_call(engine: Engine, name: str, args: tuple, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
    try:
        result = getattr(engine, name)(*args)
    except Exception as exc:  # the caller gets the error; the loop goes on
        loop.call_soon_threadsafe(_settle, future, None, exc)
    else:
        loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
