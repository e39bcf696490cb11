"""The engine's own process: `python -m deployments.scheduler.transports.child FD`, started by EngineProcess.

A Scheduler replica's event loop spends Python time on every request and streamed chunk (Serve's request
handling, gRPC, pickling). On the engine's thread that time holds the GIL between the forward pass's
ops, and measured on 2 cores it slowed every step by about a third; in this process the steps never wait
for it. The replica talks to it over a socket (`multiprocessing.connection` framing):

  replica -> child: the EngineConfig, then AddRequest / AbortRequest / MemoryQuery / Stop
  child -> replica: Ready or StartFailed, then one Stepped per step (every chunk of the step, the
                    refusals of the requests it was sent, the info snapshot), and MemoryAnswer

The child exits when told to stop or when the socket closes (the replica is gone).
"""

import logging
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from deployments.config import EngineConfig
from deployments.log_setup import configure_logging
from deployments.messages.memory import ReplicaMemory
from deployments.messages.prefix import PrefixDigest
from deployments.messages.replies import ContextLengthError, EngineChunk, FinishReason
from deployments.messages.requests import EngineRequest
from deployments.messages.status import ContextRefusal, InvalidPrompt
from deployments.scheduler.engine.core import ENGINE_CALLS, Engine, EngineInfo
from deployments.scheduler.memory_report import memory_figures_of, replica_memory
from deployments.scheduler.transports.store_relay import RelayStoreLink

log = logging.getLogger("tensorfold.engine")
INFO_INTERVAL_S = 0.05  # snapshots (counters, histograms) cost a pickle: not one per step under load


@dataclass
class AddRequest:
    request: EngineRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class MemoryQuery:
    query_id: int
    reset_peak: bool


@dataclass
class EngineCall:
    query_id: int
    name: str  # one of ENGINE_CALLS
    args: tuple


@dataclass
class EngineCallAnswer:
    query_id: int
    value: object
    error: str | None = None


@dataclass
class Stop:
    pass


@dataclass
class Ready:
    info: EngineInfo


@dataclass
class StartFailed:
    message: str


@dataclass
class Stepped:
    # After the step, at most every INFO_INTERVAL_S while busy and always once idle; else None.
    info: EngineInfo | None
    memory_figures: dict[str, int]  # this process's device memory (CUDA or MLX) and footprint, with each info
    chunks: list[EngineChunk] = field(default_factory=list)
    refusals: list[tuple[str, ContextRefusal | InvalidPrompt]] = field(default_factory=list)
    failed: str | None = None  # the step raised: every request in flight ended with this error
    digest: PrefixDigest | None = None  # the resident blocks' keys for the router, when they changed


@dataclass
class MemoryAnswer:
    query_id: int
    memory: ReplicaMemory


def serve(conn: Connection) -> None:
    config: EngineConfig = conn.recv()
    link = RelayStoreLink(conn) if config.learning else None
    try:
        engine = Engine(config, link)
    except Exception as exc:  # the replica raises it from its constructor: the deployment fails to start
        log.exception("the engine could not start")
        conn.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(Ready(engine.info()))
    try:
        _run(engine, conn, link)
    except (EOFError, OSError):  # the replica closed the socket: nothing is left to serve
        log.info("the Scheduler replica is gone; the engine process exits")
    finally:
        engine.shutdown()


def _run(engine: Engine, conn: Connection, link: RelayStoreLink | None) -> None:
    device = str(engine.info().device)
    info_sent_at = 0.0
    while True:
        out = Stepped(info=None, memory_figures={})
        handled = False
        while (link is not None and link.pending) or conn.poll(_wait(engine, handled)):
            message = link.pending.popleft() if link is not None and link.pending else conn.recv()
            if isinstance(message, Stop):
                engine.finish_writes()
                return
            handled = True
            _handle(engine, conn, message, out)
        if not engine.has_work() and not handled and engine.has_idle_work():
            engine.idle_work()  # one piece to disk; a request arriving meanwhile waits for it alone
        if engine.has_work():
            try:
                out.chunks.extend(engine.step())
            except Exception:  # a bug in the step: end what is in flight rather than hang it
                log.exception("engine step failed; ending every request in flight")
                engine.abort_all()
                out.failed = "internal engine error"
        now = time.monotonic()
        if not engine.has_work() or now - info_sent_at >= INFO_INTERVAL_S:
            out.info, out.memory_figures, info_sent_at = engine.info(), memory_figures_of(device), now
        out.digest = engine.fresh_digest(force=not engine.has_work())
        conn.send(out)


def _wait(engine: Engine, handled: bool) -> float | None:
    """How long to wait for a message: not at all while there is work (idle writes included)."""
    return 0.0 if engine.has_work() or handled or engine.has_idle_work() else None


def _handle(engine: Engine, conn: Connection, message: object, out: Stepped) -> None:
    if isinstance(message, AddRequest):
        _add(engine, message.request, out)
    elif isinstance(message, AbortRequest):
        engine.abort_request(message.request_id)
    elif isinstance(message, MemoryQuery):
        conn.send(MemoryAnswer(message.query_id, replica_memory("", engine, message.reset_peak)))
    elif isinstance(message, EngineCall) and message.name in ENGINE_CALLS:
        try:
            conn.send(EngineCallAnswer(message.query_id, getattr(engine, message.name)(*message.args)))
        except Exception as exc:  # the caller gets the error; the engine goes on
            log.exception("engine call %s failed", message.name)
            conn.send(EngineCallAnswer(message.query_id, None, f"{type(exc).__name__}: {exc}"))
    else:
        log.error("unknown message for the engine process: %r", type(message).__name__)


def _add(engine: Engine, request: EngineRequest, out: Stepped) -> None:
    """Refusals go back as values, before the request's first chunk; other faults end only this request."""
    try:
        engine.validate(request)
    except ContextLengthError as exc:
        out.refusals.append((request.request_id, ContextRefusal.from_error(exc)))
        return
    except ValueError as exc:
        param = getattr(exc, "param", request.prompt_param)
        out.refusals.append((request.request_id, InvalidPrompt(str(exc), param)))
        return
    try:
        engine.add_request(request)
    except Exception as exc:
        log.exception("could not add request %s", request.request_id)
        out.chunks.append(EngineChunk(request.request_id, finish_reason=FinishReason.ERROR, error=str(exc)))


def main() -> None:
    configure_logging()
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    # Run the imported module's main, not this `__main__` copy: messages must pickle under the module's name.
    from deployments.scheduler.transports.child import main as module_main

    module_main()
