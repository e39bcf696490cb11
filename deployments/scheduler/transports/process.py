"""Drives an engine that runs in a child process (engine_child.py) from a Scheduler replica.

The replica keeps the StreamHub (its callers' mailboxes); two threads move messages: a sender drains an
outbox (so a large prompt never blocks the event loop on the socket), a reader hands every step's chunks
to the hub and keeps the latest info snapshot. If the child dies, every request in flight ends with an
error and `alive()` turns false, so Serve's health check replaces the replica.
"""

import asyncio
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from deployments.config import EngineConfig
from deployments.messages.memory import ReplicaMemory
from deployments.messages.prefix import PrefixDigest
from deployments.messages.requests import EngineRequest
from deployments.messages.status import ContextRefusal, InvalidPrompt
from deployments.prompt_store.links import STORE_FLUSH_S, ActorStoreLink
from deployments.scheduler.engine.core import EngineInfo
from deployments.scheduler.transports.child import (
    AbortRequest,
    AddRequest,
    EngineCall,
    EngineCallAnswer,
    MemoryAnswer,
    MemoryQuery,  # fmt: skip
    Ready,
    StartFailed,
    Stepped,
    Stop,
)
from deployments.scheduler.transports.hub import Delivery, StreamHub
from deployments.scheduler.transports.store_relay import StoreCall, answer_store_call

log = logging.getLogger("tensorfold.engine")
MEMORY_TIMEOUT_S = 5.0
CALL_TIMEOUT_S = 120.0  # an imprint load reads a whole conversation from disk
STOP_TIMEOUT_S = 30.0
# The replica's event loop, the sender and the reader share the GIL. A thread woken by its socket waits for
# the loop to yield it for up to Python's switch interval (5 ms by default), and every request and every
# step's chunks cross one of them: measured at 16 streams, 0.5 ms took 3 to 4 points of throughput back.
GIL_SWITCH_INTERVAL_S = 0.0005
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds `deployments`: the child imports it from here


class EngineProcess(StreamHub):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._conn, self._process = _start_child()
        try:
            self._conn.send(config)
            first = self._conn.recv()  # blocks until the model is loaded, as building it in-process does
        except (EOFError, OSError):  # it died before answering (an import error, a crash while loading)
            first = StartFailed(f"it exited with status {self._process.wait()}")
        if not isinstance(first, Ready):
            self._process.wait(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine process did not start: {getattr(first, 'message', first)}")
        self._info: EngineInfo = first.info
        self._digest = PrefixDigest(config.block_size, b"")
        self._memory_figures: dict[str, int] = {}
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._queries: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # memory and engine calls
        self._query_ids = itertools.count()
        self._store = ActorStoreLink(config) if config.learning else None  # the child's relayed calls
        self._stopping = False
        self._alive = True
        self._sender = threading.Thread(target=self._send_loop, name="tensorfold-engine-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="tensorfold-engine-read", daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._sender.start()
        self._reader.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._outbox.put(Stop())
        self._outbox.put(None)  # ends the sender after Stop is written
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._process.kill()
        self._reader.join(timeout=STORE_FLUSH_S)  # it relays the child's last writes
        if self._store is not None:
            self._store.flush(STORE_FLUSH_S)
        self._conn.close()

    def alive(self) -> bool:
        return self._alive

    def info(self) -> EngineInfo:
        """The snapshot the child sent after its latest step."""
        return self._info

    def memory_figures(self) -> dict[str, int]:
        return self._memory_figures

    def prefix_digest(self) -> PrefixDigest:
        """The latest digest of the blocks the child holds (for the router)."""
        return self._digest

    async def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return await self._ask(lambda query_id: MemoryQuery(query_id, reset_peak), MEMORY_TIMEOUT_S)

    async def engine_call(self, name: str, *args: object) -> object:
        """One of ENGINE_CALLS, run by the child between steps."""
        return await self._ask(lambda query_id: EngineCall(query_id, name, args), CALL_TIMEOUT_S)

    async def _ask(self, message: Callable[[int], object], timeout_s: float) -> object:
        loop = asyncio.get_running_loop()
        query_id = next(self._query_ids)
        future: asyncio.Future = loop.create_future()
        self._queries[query_id] = (loop, future)
        self._outbox.put(message(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._queries.pop(query_id, None)

    # ---- caller side ----------------------------------------------------------------------------------
    def _submit(self, request: EngineRequest) -> None:
        if not self._alive:
            raise RuntimeError("the engine process has exited")
        self._outbox.put(AddRequest(request))

    def _cancel(self, request_id: str) -> None:
        self._outbox.put(AbortRequest(request_id))

    # ---- threads --------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:  # the child is gone; the reader ends what is in flight
                return

    def _read_loop(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                if isinstance(message, Stepped):
                    self._on_step(message)
                elif isinstance(message, MemoryAnswer):
                    self._on_answer(message.query_id, message.memory)
                elif isinstance(message, EngineCallAnswer):
                    error = None if message.error is None else RuntimeError(message.error)
                    self._on_answer(message.query_id, message.value, error)
                elif isinstance(message, StoreCall) and self._store is not None:
                    reply = answer_store_call(self._store, message)
                    if reply is not None:
                        self._outbox.put(reply)
            except Exception:  # a bug here must not stop the reader: every stream depends on it
                log.exception("could not hand over a message from the engine process")
        self._alive = False
        if not self._stopping:
            log.error("the engine process exited (status %s); ending every request in flight", self._process.poll())
        self.fail_all("the engine process exited" if not self._stopping else "the server is shutting down")

    def _on_step(self, step: Stepped) -> None:
        if step.info is not None:
            self._info, self._memory_figures = step.info, step.memory_figures
        if step.digest is not None:
            self._digest = step.digest
        items: list[tuple[str, Delivery]] = [(rid, _refusal_error(refusal)) for rid, refusal in step.refusals]
        items += [(chunk.request_id, chunk) for chunk in step.chunks]
        self.deliver(items)
        if step.failed is not None:
            self.fail_all(step.failed)

    def _on_answer(self, query_id: int, value: object, error: Exception | None = None) -> None:
        entry = self._queries.get(query_id)
        if entry is not None:
            loop, future = entry
            loop.call_soon_threadsafe(_resolve, future, value, error)


class RefusedPrompt(ValueError):
    """A prompt the engine cannot run, as its process reported it (the same 400 as in-process)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _refusal_error(refusal: ContextRefusal | InvalidPrompt) -> Exception:
    if isinstance(refusal, ContextRefusal):
        return refusal.to_error()
    return RefusedPrompt(refusal.message, refusal.param)


def _resolve(future: asyncio.Future, value: object, error: Exception | None) -> None:
    if future.done():  # (it timed out already)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _start_child() -> tuple[Connection, subprocess.Popen]:
    """The child on one end of a socket pair; it inherits this replica's environment (GPUs, threads)."""
    ours, theirs = socket.socketpair()
    child_fd = theirs.detach()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        process = subprocess.Popen([sys.executable, "-m", "deployments.scheduler.transports.child", str(child_fd)],
                                   pass_fds=(child_fd,), env=env)  # fmt: skip
    finally:
        os.close(child_fd)
    return Connection(ours.detach()), process
