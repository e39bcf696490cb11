"""How an engine reaches its node's store: in-process (tests, benchmarks) or over Ray (a Scheduler's own
thread). An engine in the replica's child process goes through the replica (scheduler/store_relay.py)."""

from deployments.config import EngineConfig
from deployments.messages.store import BlockRows, PieceWrite, SetIndex, StoreCaps, StoreStats
from deployments.prompt_store.actor import PromptStoreActor

GIB = 1 << 30
STORE_FLUSH_S = 5.0  # after the engine's own 15 s of writes: a planned stop ends within Serve's 20 s


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
    """This node's PromptStore actor; writes are sent without waiting, and awaited only at shutdown."""

    def __init__(self, config: EngineConfig) -> None:
        import ray

        from deployments.prompt_store.actor import store_actor

        self._ray = ray
        self._actor = store_actor(config.learn_dir, store_caps(config))
        self._writes: list = []

    def open_set(self, set_id: str) -> SetIndex:
        return self._ray.get(self._actor.open_set.remote(set_id))

    def write(self, piece: PieceWrite) -> None:
        self._writes = [ref for ref in self._writes if not _done(self._ray, ref)]
        self._writes.append(self._actor.write.remote(piece))

    def read(self, set_id: str, hashes: list[bytes], state_at: bytes | None = None) -> BlockRows | None:
        return self._ray.get(self._actor.read.remote(set_id, hashes, state_at))

    def delete_set(self, set_id: str) -> int:
        return self._ray.get(self._actor.delete_set.remote(set_id))

    def stats(self, set_id: str) -> StoreStats:
        return self._ray.get(self._actor.stats.remote(set_id))

    def flush(self, timeout_s: float) -> None:
        """Wait for the writes sent so far (a planned stop finishes what is waiting)."""
        if self._writes:
            self._ray.wait(self._writes, num_returns=len(self._writes), timeout=timeout_s)


def _done(ray: object, ref: object) -> bool:
    ready, _ = ray.wait([ref], timeout=0)  # type: ignore[attr-defined]
    return bool(ready)
