"""Drives an engine that runs in a child process (transports/child.py) from a Scheduler replica.

The replica keeps the StreamHub (its callers' mailboxes); two threads move messages: a sender drains an
outbox (so a large prompt never blocks the event loop on the socket), a reader hands every turn's Stepped
to the hub and answers the child's relayed store calls. If the child dies, every request in flight ends
with an error, `alive()` turns false and `lost` says why, and `on_lost` is called (the Scheduler replica
then exits, so Serve replaces it at its next health check).
"""

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
from deployments.messages.engine_process import Inbox, Ready, RelayedStoreCall, StartFailed, Stepped, Stop
from deployments.messages.requests import EngineRequest
from deployments.prompt_store.links import STORE_FLUSH_S, ActorStoreLink, StoreLink
from deployments.scheduler.transports.hub import StreamHub
from deployments.scheduler.transports.store_relay import answer_store_call

log = logging.getLogger("tensorfold.engine")
STOP_TIMEOUT_S = 30.0
# The replica's event loop, the sender and the reader share the GIL. A thread woken by its socket waits for
# the loop to yield it for up to Python's switch interval (5 ms by default), and every request and every
# step's chunks cross one of them: measured at 16 streams, 0.5 ms took 3 to 4 points of throughput back.
GIL_SWITCH_INTERVAL_S = 0.0005
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # holds `deployments`: the child imports it from here


class EngineProcess(StreamHub):
    def __init__(
        self, config: EngineConfig, store: StoreLink | None = None, on_lost: Callable[[str], None] | None = None
    ) -> None:
        """`store`: the link the child's store calls are relayed to (one is opened here if learn is on);
        `on_lost(reason)`: called on the reader thread once the child has died unasked, after every request in
        flight has been ended."""
        self._conn, self._process = _start_child()
        try:
            self._conn.send(config)
            first = self._conn.recv()  # blocks until the model is loaded, as building it in-process does
        except (EOFError, OSError):  # it died before answering (an import error, a crash while loading)
            first = StartFailed(f"it exited with status {self._process.wait()}")
        if not isinstance(first, Ready):
            self._process.wait(timeout=STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine process did not start: {getattr(first, 'message', first)}")
        super().__init__(config, first.info, first.memory_figures)
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._store = store or (ActorStoreLink(config) if config.learning else None)  # the child's relayed calls
        self._stopping = False
        self._alive = True
        self.lost = ""  # why the engine stopped unasked ("" while it runs, or after a planned stop)
        self._on_lost = on_lost
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

    # ---- caller side ----------------------------------------------------------------------------------
    def _submit(self, request: EngineRequest) -> None:
        if not self._alive:
            raise RuntimeError("the engine process has exited")
        super()._submit(request)

    def _send(self, inbox: Inbox) -> None:
        self._outbox.put(inbox)

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
                    self.on_stepped(message)
                elif isinstance(message, RelayedStoreCall) and self._store is not None:
                    reply = answer_store_call(self._store, message)
                    if reply is not None:
                        self._outbox.put(reply)
            except Exception:  # a bug here must not stop the reader: every stream depends on it
                log.exception("could not hand over a message from the engine process")
        if self._stopping:
            self._alive = False
            self.fail_all("the server is shutting down")
            return
        self.lost = "the engine process exited"  # first: whoever sees `alive()` false finds the reason
        self._alive = False
        log.error("%s (status %s); ending every request in flight", self.lost, self._process.poll())
        self.fail_all(self.lost)
        if self._on_lost is not None:
            self._on_lost(self.lost)


def _start_child() -> tuple[Connection, subprocess.Popen]:
    """The child on one end of a socket pair; it inherits this replica's environment (GPUs, threads)."""
    ours, theirs = socket.socketpair()
    child_fd = theirs.detach()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "deployments.scheduler.transports.child", str(child_fd)],
            pass_fds=(child_fd,),
            env=env,
        )
    finally:
        os.close(child_fd)
    return Connection(ours.detach()), process
