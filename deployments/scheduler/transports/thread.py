"""Runs an Engine on a thread of this process (tests, benchmarks, tensor-parallel replicas).

Request coroutines and the engine thread exchange through a locked `Inbox`; the thread waits for it (or
for the engine's own work), runs one `Engine.run_once` and hands the turn to the StreamHub, which wakes
each caller loop once. Refusals are checked on the caller's thread, so a refused request never waits for
a step.
"""

import logging
import threading

from deployments.messages.engine_process import Inbox
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.hub import StreamHub

log = logging.getLogger("tensorfold.engine")


class EngineLoop(StreamHub):
    def __init__(self, engine: Engine) -> None:
        super().__init__(engine.config, engine.info(), engine.memory_figures())
        self.engine = engine
        self._wake = threading.Condition(self._lock)
        self._inbox = Inbox()  # what arrived since the thread's last turn
        self._stopping = False
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

    # ---- caller side ----------------------------------------------------------------------------------
    def _check(self, request: EngineRequest) -> Refusal | None:
        return self.engine.check(request)  # on the caller's thread, so a refusal never waits for a step

    def _send(self, inbox: Inbox) -> None:
        with self._wake:
            self._inbox.extend(inbox)
            self._wake.notify()

    # ---- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self.engine.wants_step()):
                    self._wake.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, Inbox()
            self.on_stepped(self.engine.run_once(inbox))
        self.engine.finish_writes()  # a planned stop writes what is waiting, and waits for the store to have it
        self.fail_all("the server is shutting down")
