"""The store for an engine in the replica's child process: the child cannot call Ray, so its typed store
calls go to the replica over their socket, and the replica makes them on its own link (the PromptStore
actor).

child -> replica: RelayedStoreCall (a write is sent and forgotten; other calls wait for their StoreReply, and
                  whatever else arrives meanwhile is kept, in order, for the child's loop)
replica -> child: StoreReply
"""

import itertools
import logging
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from deployments.messages.engine_process import NO_REPLY, RelayedStoreCall, StoreReply
from deployments.messages.store import PieceWrite, StoreCall, WritePiece
from deployments.prompt_store.failures import StoreFailedError
from deployments.prompt_store.links import StoreLink

log = logging.getLogger("tensorfold.store")


class RelayStoreLink(StoreLink):
    """The child's StoreLink; `pending` holds the messages that arrived while a call waited."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ids = itertools.count()
        self.pending: deque[object] = deque()

    def _carry(self, call: StoreCall[Any]) -> object:
        call_id = next(self._ids)
        self._conn.send(RelayedStoreCall(call_id, call))
        while True:
            message = self._conn.recv()
            if isinstance(message, StoreReply) and message.call_id == call_id:
                if message.error is not None:
                    raise StoreFailedError(message.error)
                return message.value
            self.pending.append(message)

    def write(self, piece: PieceWrite) -> None:
        """The parent relays it to the actor and waits for the writes as it stops (EngineProcess.shutdown)."""
        self._conn.send(RelayedStoreCall(NO_REPLY, WritePiece(piece)))


def answer_store_call(link: StoreLink, relayed: RelayedStoreCall) -> StoreReply | None:
    """Make a relayed call on the replica's own link; None for a write (nobody waits for it). A store that
    failed is the child's to log (once per burst: a read prefills instead); anything else is a bug here."""
    call = relayed.call
    try:
        if relayed.call_id == NO_REPLY:
            assert isinstance(call, WritePiece), f"only a write is sent without waiting, not {type(call).__name__}"
            link.write(call.piece)
            return None
        value: object = link.ask(call)
    except Exception as exc:
        if not isinstance(exc, StoreFailedError):
            log.exception("prompt store call %s failed", type(call).__name__)
        return None if relayed.call_id == NO_REPLY else StoreReply(relayed.call_id, None, str(exc))
    return StoreReply(relayed.call_id, value)
