"""The Scheduler deployment: one model copy, a thin Serve wrapper over the engine's driver.

At tensor-parallel size 1 the engine steps in a child process (EngineProcess, `engine_process`), else on
a thread of this replica (EngineLoop); this replica's event loop only moves chunks, so streams and health
checks stay responsive. `generate` is an async generator: each item is one coalesced
EngineChunk holding every token ready since the last one (never a Ray call per token); refusals come
as values (see wire.py) before any chunk.

At tensor-parallel size N > 1 the replica sits in a placement group whose bundle i is rank i's (bundle
0 also holds this replica); the engine starts its rank actors in the current placement group.
"""

import os
from collections.abc import AsyncIterator
from dataclasses import fields, replace

from ray import serve

from deployments.config import EngineConfig
from deployments.log_setup import configure_logging
from deployments.messages.memory import ReplicaMemory
from deployments.messages.replies import EngineChunk, ImprintAnswer
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.status import EngineInfo, ReplicaStatus, UpstreamItem
from deployments.messages.store import StoreUnavailable
from deployments.prompt_store.links import ActorStoreLink
from deployments.routing.request_router import routing_stats
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.ray_metrics import RayMetricsExport
from deployments.scheduler.transports.hub import StreamHub
from deployments.scheduler.transports.process import EngineProcess
from deployments.scheduler.transports.thread import EngineLoop
from deployments.serve_sockets import configure_serve_sockets


async def engine_stream(loop: StreamHub, request: EngineRequest, replica: str = "") -> AsyncIterator[UpstreamItem]:
    """The loop's items for one request (its chunks, or its refusal alone); the last chunk names `replica`,
    the replica that served it."""
    stream = loop.generate(request)
    try:
        async for item in stream:
            if isinstance(item, EngineChunk) and item.stats is not None:
                item.stats.replica = replica
            yield item
    finally:
        # A cancelled stream (the client left) closes this generator: closing the engine's iterator aborts
        # the request there, which frees its KV blocks at the next step.
        await stream.aclose()


def replica_status(replica: str, info: EngineInfo, memory_figures: dict[str, int]) -> ReplicaStatus:
    snapshot = {f.name: getattr(info, f.name) for f in fields(EngineInfo)}
    return ReplicaStatus(**snapshot, replica=replica, memory=memory_figures)


def start_driver(config: EngineConfig, link: ActorStoreLink | None) -> EngineLoop | EngineProcess:
    """The engine's driver, started: a child process where the config asks for one and allows it; `link`:
    the node's prompt store (the engine's own, or the one a child's calls are relayed to)."""
    driver: EngineLoop | EngineProcess
    if config.engine_process and config.tensor_parallel_size == 1:
        driver = EngineProcess(config, link)
    else:
        driver = EngineLoop(Engine(config, link))
    driver.start()
    return driver


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (constructed directly in-process): the process is the replica
        return f"pid-{os.getpid()}"


@serve.deployment(name="Scheduler", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=1024)
class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._store = ActorStoreLink(config) if config.learning else None
        self._loop = start_driver(config, self._store)
        self._replica = _replica_tag()
        self._ray_metrics = RayMetricsExport(self._loop.info)  # the readings in Ray's dashboard too

    async def generate(self, request: EngineRequest) -> AsyncIterator[UpstreamItem]:
        stream = engine_stream(self._loop, request, self._replica)
        try:
            async for item in stream:
                self._ray_metrics.observe(item)
                yield item
        finally:
            await stream.aclose()

    async def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        return await self._loop.engine_call("imprint", query)  # type: ignore[return-value]

    async def client_left(self) -> None:
        """Ingress saw a client leave its streamed reply: counted with the disconnections."""
        await self._loop.engine_call("client_left")

    async def forget_disk(self) -> int | StoreUnavailable:
        return await self._loop.engine_call("forget_disk")  # type: ignore[return-value]

    def record_routing_stats(self) -> dict[str, object]:
        """Serve's routing stats, read by the prefix-affinity router: the blocks held and the queue."""
        info = self._loop.info()
        return routing_stats(self._loop.prefix_digest(), info.running + info.waiting)

    async def info(self) -> ReplicaStatus:
        # The driver's snapshot after the latest step: the engine's own state belongs to its thread or process.
        status = replica_status(self._replica, self._loop.info(), self._loop.memory_figures())
        if self._store is not None and status.store is not None:  # the store's figures now, not at the last write
            status.store = await self._store.live_stats() or status.store
        return status

    async def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return replace(await self._loop.memory(reset_peak), replica=self._replica)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine has stopped (its process died, or its thread ended)."""
        if not self._loop.alive():
            raise RuntimeError("the engine has stopped")

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.shutdown()
        export = getattr(self, "_ray_metrics", None)
        if export is not None:
            export.stop()
