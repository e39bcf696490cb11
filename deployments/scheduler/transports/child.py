"""The engine's own process: `python -m deployments.scheduler.transports.child FD`, started by EngineProcess.

A Scheduler replica's event loop spends Python time on every request and streamed chunk (Serve's request
handling, gRPC, pickling). On the engine's thread that time holds the GIL between the forward pass's
ops, and measured on 2 cores it slowed every step by about a third; in this process the steps never wait
for it. The replica talks to it over a socket (`multiprocessing.connection` framing, plain pickle), in
the messages of deployments/messages/engine_process.py (importable by name, whichever module runs as
`__main__`):

  replica -> child: the EngineConfig, then an Inbox per batch of adds, aborts and calls; Stop
  child -> replica: Ready or StartFailed, then one Stepped per turn of `Engine.run_once`

The child exits when told to stop or when the socket closes (the replica is gone).
"""

import logging
import sys
from multiprocessing.connection import Connection

from deployments.config import EngineConfig
from deployments.log_setup import configure_logging
from deployments.messages.engine_process import Inbox, Ready, StartFailed, Stop
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.transports.store_relay import RelayStoreLink

log = logging.getLogger("tensorfold.engine")


def serve(conn: Connection) -> None:
    config: EngineConfig = conn.recv()
    link = RelayStoreLink(conn) if config.learning else None
    try:
        engine = Engine(config, link)
    except Exception as exc:  # the replica raises it from its constructor: the deployment fails to start
        log.exception("the engine could not start")
        conn.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    conn.send(Ready(engine.info(), engine.memory_figures()))
    try:
        _run(engine, conn, link)
    except (EOFError, OSError):  # the replica closed the socket: nothing is left to serve
        log.info("the Scheduler replica is gone; the engine process exits")
    finally:
        engine.shutdown()


def _run(engine: Engine, conn: Connection, link: RelayStoreLink | None) -> None:
    while True:
        inbox = Inbox()
        # Everything that has arrived joins this turn; with nothing to do, wait for the next message.
        while (link is not None and link.pending) or conn.poll(0.0 if inbox or engine.wants_step() else None):
            message = link.pending.popleft() if link is not None and link.pending else conn.recv()
            if isinstance(message, Stop):
                engine.finish_writes()
                return
            if isinstance(message, Inbox):
                inbox.extend(message)
            else:
                log.error("unknown message for the engine process: %r", type(message).__name__)
        conn.send(engine.run_once(inbox))


def main() -> None:
    configure_logging()
    serve(Connection(int(sys.argv[1])))


if __name__ == "__main__":
    main()
