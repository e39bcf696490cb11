"""How an engine reaches its node's store: one `StoreLink` over the typed store calls, carried in-process
(tests, benchmarks) or over Ray (a Scheduler's own thread). An engine in the replica's child process goes
through the replica (scheduler/transports/store_relay.py)."""

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

from deployments.config import EngineConfig
from deployments.messages.calls import Reply
from deployments.messages.store import OpenSet, PieceWrite, ReadStats, StoreCall, StoreCaps, StoreStats, WritePiece
from deployments.prompt_store.actor import PromptStoreActor, store_actor
from deployments.prompt_store.failures import UNAVAILABLE, FailureBurst, StoreFailedError

GIB = 1 << 30
STORE_FLUSH_S = 5.0  # after the engine's own 15 s of writes: a planned stop ends within Serve's 20 s
RESTART_WAIT_S = 10.0  # a call waits this long for a restarting actor (Ray restarts it in a second or two)
RETRY_PAUSE_S = 0.25
CALL_TIMEOUT_S = 60.0  # an imprint load reads a whole conversation; a call queued for a restart waits too
PROBE_TIMEOUT_S = 2.0  # /health's question to the actor: past it, the store is reported unavailable
UNANSWERED = "the prompt store's actor is not answering (it restarts after a failure)"


def store_caps(config: EngineConfig) -> StoreCaps:
    return StoreCaps(
        int(config.learn_gib * GIB), int(config.learn_min_free_gib * GIB), int(config.learn_daily_gib * GIB)
    )


class StoreLink(ABC):
    """The one way an engine calls its node's store: typed calls (messages/store.py), each reply checked
    against its call's type; a subclass only carries them (in-process, over Ray, or relayed)."""

    def ask(self, call: StoreCall[Reply]) -> Reply:
        """The store's answer (StoreFailedError when it failed or did not answer)."""
        return call.reply(self._carry(call))

    @abstractmethod
    def _carry(self, call: StoreCall[Any]) -> object:
        """Make the call where the store is, and wait for its answer."""

    @abstractmethod
    def write(self, piece: PieceWrite) -> None:
        """Send a piece to be written, never waiting for the disk."""

    def flush(self, timeout_s: float) -> None:
        """Wait (up to `timeout_s`) for the writes sent so far (default: each was done when sent)."""


class LocalStoreLink(StoreLink):
    """The store's files opened in this process (no actor): tests, benchmarks."""

    def __init__(self, config: EngineConfig) -> None:
        self._store = PromptStoreActor(config.learn_dir, store_caps(config))

    def _carry(self, call: StoreCall[Any]) -> object:
        return self._store.answer(call)

    def write(self, piece: PieceWrite) -> None:
        self._store.answer(WritePiece(piece))


class ActorStoreLink(StoreLink):
    """This node's PromptStore actor; writes are sent without waiting, and awaited only at shutdown.

    The actor restarts after a crash (store_actor's max_restarts): a call made while it restarts is retried
    on a re-resolved handle for up to RESTART_WAIT_S, then fails with StoreFailedError; a write the dead
    actor never ran is counted in `writes_lost`, and joins the figures the store's stats report.
    """

    def __init__(self, config: EngineConfig) -> None:
        import ray

        self._ray = ray
        self._root, self._caps = config.learn_dir, store_caps(config)
        self._actor = store_actor(self._root, self._caps)
        self._writes: list = []
        self.set_id: str | None = None  # the set its engine opened: the one /health's figures are about
        self.writes_lost = 0  # writes sent to an actor that died before running them
        self.lost = FailureBurst("prompt store: a write sent to its actor", "its states stay in RAM only")

    def _carry(self, call: StoreCall[Any]) -> object:
        if isinstance(call, OpenSet):
            self.set_id = call.set_id
        value = self._remote(call)
        if isinstance(value, StoreStats):  # after the writes sent before: a lost one is counted first
            self._prune()
            value = self._with_own_figures(value)
        return value

    def write(self, piece: PieceWrite) -> None:
        self._prune()
        self._writes.append(self._actor.answer.remote(WritePiece(piece)))

    async def live_stats(self, timeout_s: float = PROBE_TIMEOUT_S) -> StoreStats | None:
        """The store's figures now, for /health and /metrics (None before the engine opened its set); an
        actor that does not answer within `timeout_s` is reported unavailable, with the reason."""
        if self.set_id is None:
            return None
        try:
            stats: StoreStats = await asyncio.wait_for(self._actor.answer.remote(ReadStats(self.set_id)), timeout_s)
        except (self._ray.exceptions.RayError, asyncio.TimeoutError):
            return self._with_own_figures(StoreStats(available=False, unavailable_reason=UNANSWERED))
        return self._with_own_figures(stats)

    def flush(self, timeout_s: float) -> None:
        """Wait for the writes sent so far (a planned stop finishes what is waiting)."""
        if self._writes:
            self._ray.wait(self._writes, num_returns=len(self._writes), timeout=timeout_s)

    def _remote(self, call: StoreCall[Any]) -> object:
        """One call, retried on a re-resolved handle while the actor restarts (a write is never retried:
        its piece is queued again only if the engine still holds it, which the store's index decides)."""
        errors = self._ray.exceptions
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                value: object = self._ray.get(self._actor.answer.remote(call), timeout=CALL_TIMEOUT_S)
            except errors.RayTaskError as exc:  # the store raised: its own error, without Ray's traceback
                cause = exc.cause if exc.cause is not None else exc
                raise StoreFailedError(f"{type(cause).__name__}: {cause}") from None
            except (errors.RayActorError, errors.GetTimeoutError) as exc:
                if isinstance(exc, errors.RayActorError) and time.monotonic() < deadline:
                    time.sleep(RETRY_PAUSE_S)
                    self._actor = store_actor(self._root, self._caps)  # the same actor, or a new one if it is gone
                    continue
                raise StoreFailedError(UNANSWERED) from None  # the engine logs it, once per burst
            self.lost.succeeded()
            return value

    def _prune(self) -> None:
        """Forget the writes that are done, counting those the actor died before running."""
        if not self._writes:
            return
        done, self._writes = self._ray.wait(self._writes, num_returns=len(self._writes), timeout=0)
        for ref in done:
            try:
                self._ray.get(ref, timeout=0)
            except self._ray.exceptions.RayError as exc:
                self.writes_lost += 1
                self.lost.failed(UNAVAILABLE, f"the actor died before running it ({type(exc).__name__})")
                self._actor = store_actor(self._root, self._caps)

    def _with_own_figures(self, stats: StoreStats) -> StoreStats:
        failures = dict(stats.write_failures)
        if self.writes_lost:
            failures[UNAVAILABLE] = failures.get(UNAVAILABLE, 0) + self.writes_lost
        return replace(stats, write_failures=failures)
