"""How an engine reaches its node's store: in-process (tests, benchmarks) or over Ray (a Scheduler's own
thread). An engine in the replica's child process goes through the replica (scheduler/store_relay.py)."""

import asyncio
import time
from dataclasses import replace

from deployments.config import EngineConfig
from deployments.messages.store import BlockRows, PieceWrite, SetIndex, StoreCaps, StoreStats
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


class LocalStoreLink(PromptStoreActor):
    """The store's files opened in this process (no actor): tests, benchmarks."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config.learn_dir, store_caps(config))

    def flush(self, timeout_s: float) -> None:
        """Writes here are done when `write` returns."""


class ActorStoreLink:
    """This node's PromptStore actor; writes are sent without waiting, and awaited only at shutdown.

    The actor restarts after a crash (store_actor's max_restarts): a call made while it restarts is retried
    on a re-resolved handle for up to RESTART_WAIT_S, then fails with StoreFailedError; a write the dead
    actor never ran is counted in `writes_lost`.
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

    def open_set(self, set_id: str) -> SetIndex:
        self.set_id = set_id
        return self._call("open_set", set_id)  # type: ignore[return-value]

    def write(self, piece: PieceWrite) -> None:
        self._prune()
        self._writes.append(self._actor.write.remote(piece))

    def read(self, set_id: str, hashes: list[bytes], state_at: bytes | None = None) -> BlockRows | None:
        return self._call("read", set_id, hashes, state_at)  # type: ignore[return-value]

    def lookup(self, set_id: str, hashes: list[bytes], with_states: bool = False) -> SetIndex:
        return self._call("lookup", set_id, hashes, with_states)  # type: ignore[return-value]

    def delete_set(self, set_id: str) -> int:
        return self._call("delete_set", set_id)  # type: ignore[return-value]

    def stats(self, set_id: str) -> StoreStats:
        """The actor's figures for the set (after the writes sent before: a lost one is counted first)."""
        stats: StoreStats = self._call("stats", set_id)  # type: ignore[assignment]
        self._prune()
        return self._with_own_figures(stats)

    async def live_stats(self, timeout_s: float = PROBE_TIMEOUT_S) -> StoreStats | None:
        """The store's figures now, for /health and /metrics (None before the engine opened its set); an
        actor that does not answer within `timeout_s` is reported unavailable, with the reason."""
        if self.set_id is None:
            return None
        try:
            stats = await asyncio.wait_for(self._actor.stats.remote(self.set_id), timeout_s)
        except (self._ray.exceptions.RayError, asyncio.TimeoutError):
            return self._with_own_figures(StoreStats(available=False, unavailable_reason=UNANSWERED))
        return self._with_own_figures(stats)

    def flush(self, timeout_s: float) -> None:
        """Wait for the writes sent so far (a planned stop finishes what is waiting)."""
        if self._writes:
            self._ray.wait(self._writes, num_returns=len(self._writes), timeout=timeout_s)

    def _call(self, method: str, *args: object) -> object:
        """One call, retried on a re-resolved handle while the actor restarts (a write is never retried:
        its piece is queued again only if the engine still holds it, which the store's index decides)."""
        errors = self._ray.exceptions
        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                value = self._ray.get(getattr(self._actor, method).remote(*args), timeout=CALL_TIMEOUT_S)
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
