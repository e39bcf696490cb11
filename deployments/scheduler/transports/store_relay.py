"""The store for an engine in the replica's child process: the child cannot call Ray, so its store calls
go to the replica over their socket, and the replica makes them on the PromptStore actor.

child -> replica: StoreCall (a write is sent and forgotten; other calls wait for their StoreReply, and
                  whatever else arrives meanwhile is kept, in order, for the child's loop)
replica -> child: StoreReply
"""

import itertools
import logging
from collections import deque
from multiprocessing.connection import Connection

from deployments.messages.engine_process import NO_REPLY, StoreCall, StoreReply
from deployments.messages.store import BlockRows, PieceWrite, SetIndex, StoreStats
from deployments.prompt_store.failures import StoreFailedError

log = logging.getLogger("tensorfold.store")


class RelayStoreLink:
    """The child's StoreLink; `pending` holds the messages that arrived while a call waited."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ids = itertools.count()
        self.pending: deque[object] = deque()

    def _call(self, method: str, *args: object) -> object:
        call_id = next(self._ids)
        self._conn.send(StoreCall(call_id, method, args))
        while True:
            message = self._conn.recv()
            if isinstance(message, StoreReply) and message.call_id == call_id:
                if message.error is not None:
                    raise StoreFailedError(message.error)
                return message.value
            self.pending.append(message)

    def open_set(self, set_id: str) -> SetIndex:
        return self._call("open_set", set_id)  # type: ignore[return-value]

    def write(self, piece: PieceWrite) -> None:
        self._conn.send(StoreCall(NO_REPLY, "write", (piece,)))

    def flush(self, timeout_s: float) -> None:
        """The parent relays the writes to the actor and waits for them as it stops (EngineProcess.shutdown)."""

    def read(self, set_id: str, hashes: list[bytes], state_at: bytes | None = None) -> BlockRows | None:
        return self._call("read", set_id, hashes, state_at)  # type: ignore[return-value]

    def lookup(self, set_id: str, hashes: list[bytes], with_states: bool = False) -> SetIndex:
        return self._call("lookup", set_id, hashes, with_states)  # type: ignore[return-value]

    def delete_set(self, set_id: str) -> int:
        return self._call("delete_set", set_id)  # type: ignore[return-value]

    def stats(self, set_id: str) -> StoreStats:
        return self._call("stats", set_id)  # type: ignore[return-value]


def answer_store_call(link: object, call: StoreCall) -> StoreReply | None:
    """Make a relayed call on the replica's own link; None for a write (nobody waits for it). A store that
    failed is the child's to log (once per burst: a read prefills instead); anything else is a bug here."""
    try:
        value = getattr(link, call.method)(*call.args)
    except Exception as exc:
        if not isinstance(exc, StoreFailedError):
            log.exception("prompt store call %s failed", call.method)
        return None if call.call_id == NO_REPLY else StoreReply(call.call_id, None, str(exc))
    return None if call.call_id == NO_REPLY else StoreReply(call.call_id, value)
