"""The Scheduler deployment: one model copy, a thin Serve wrapper over the engine's driver.

At tensor-parallel size 1 the engine steps in a child process (EngineProcess, `engine_process`), else on
a thread of this replica (EngineLoop); this replica's event loop only moves chunks, so streams and health
checks stay responsive. `generate` is an async generator: each item is one coalesced
EngineChunk holding every token ready since the last one (never a Ray call per token); refusals come
as values (`UpstreamItem`, deployments/messages/status.py) before any chunk.

Honest health: `info` says whether the engine takes a request now (`serving`, and why not). An engine
process that dies unasked ends its requests with an error, and the replica then exits, so Serve's next
health check sees a crashed actor and replaces it at once (an application-level failure would need three
checks in a row). A planned stop ends what still runs with `end_requests` (Ingress's drain).

At tensor-parallel size N > 1 the replica sits in a placement group whose bundle i is rank i's (bundle
0 also holds this replica); the engine starts its rank actors in the current placement group.
"""

import logging
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import fields, replace

from ray import serve

from deployments.config import EngineConfig
from deployments.log_setup import configure_logging
from deployments.messages.calls import Reply
from deployments.messages.engine_process import ClientLeft, ForgetDisk, Imprint
from deployments.messages.memory import ReplicaMemory
from deployments.messages.replies import EngineChunk, ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.slide import SlideCall
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

log = logging.getLogger("tensorfold.engine")
# After a lost engine's requests were ended: time for their error chunks to reach the callers before exiting.
LOST_EXIT_DELAY_S = 1.0
# Serve checks a replica this often: a crashed one is replaced within a period of its engine's loss.
HEALTH_CHECK_PERIOD_S = 2.0


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


def start_driver(
    config: EngineConfig, link: ActorStoreLink | None = None, on_lost: Callable[[str], None] | None = None
) -> EngineLoop | EngineProcess:
    """The engine's driver, started: a child process where the config asks for one and allows it; `link`:
    the node's prompt store (the engine's own, or the one a child's calls are relayed to); `on_lost`: called
    if that process dies unasked."""
    driver: EngineLoop | EngineProcess
    if config.engine_process and config.tensor_parallel_size == 1:
        driver = EngineProcess(config, link, on_lost)
    else:
        driver = EngineLoop(Engine(config, link))
    driver.start()
    return driver


def _serve_replica_id() -> str | None:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (constructed directly in-process)
        return None


def _exit_replica(reason: str) -> None:
    """From the reader thread of a lost engine: leave, so Serve replaces this replica (see the module doc)."""

    def leave() -> None:
        log.error("%s: this Scheduler replica exits so that Serve replaces it", reason)
        logging.shutdown()
        os._exit(1)

    threading.Timer(LOST_EXIT_DELAY_S, leave).start()


@serve.deployment(
    name="Scheduler",
    ray_actor_options={"num_cpus": 0.2},
    max_ongoing_requests=1024,
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
)
class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._store = ActorStoreLink(config) if config.learning else None
        replica_id = _serve_replica_id()
        # Outside Serve the process is the replica, and nothing would replace it: it stays, reporting the loss.
        self._loop = start_driver(config, self._store, _exit_replica if replica_id is not None else None)
        self._replica = replica_id or f"pid-{os.getpid()}"
        self._ray_metrics = RayMetricsExport(self._loop.info)  # the readings in Ray's dashboard too
        self._closing = ""  # set by a planned stop (end_requests): why new requests are refused

    def _unavailable(self) -> str:
        """Why the engine cannot take a request now ("" when it can)."""
        if self._closing:
            return self._closing
        if not self._loop.alive():
            return getattr(self._loop, "lost", "") or "the engine has stopped"
        return ""

    async def generate(self, request: EngineRequest) -> AsyncIterator[UpstreamItem]:
        unavailable = self._unavailable()
        if unavailable:  # a clean 503 in the route's format, not a failed stream
            yield Refusal(f"the model is not serving: {unavailable}", status=503, type="server_error")
            return
        stream = engine_stream(self._loop, request, self._replica)
        try:
            async for item in stream:
                self._ray_metrics.observe(item)
                yield item
        finally:
            await stream.aclose()

    async def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        return await self._loop.ask(Imprint(query))

    async def client_left(self) -> None:
        """Ingress saw a client leave its streamed reply: counted with the disconnections."""
        await self._loop.ask(ClientLeft())

    async def forget_disk(self) -> int | StoreUnavailable:
        return await self._loop.ask(ForgetDisk())

    async def slide(self, call: SlideCall[Reply]) -> Reply | None:
        """A living-weights call (docs/slide.md): None when it names another replica."""
        if call.replica and call.replica != self._replica:
            return None
        return await self._loop.ask(call)

    def record_routing_stats(self) -> dict[str, object]:
        """Serve's routing stats, read by the prefix-affinity router: the blocks held and the queue."""
        info = self._loop.info()
        return routing_stats(self._loop.prefix_digest(), info.running + info.waiting)

    async def info(self) -> ReplicaStatus:
        # The driver's snapshot after the latest step: the engine's own state belongs to its thread or process.
        status = replica_status(self._replica, self._loop.info(), self._loop.memory_figures())
        if self._store is not None and status.store is not None:  # the store's figures now, not at the last write
            status.store = await self._store.live_stats() or status.store
        status.unavailable = self._unavailable()
        status.serving = not status.unavailable
        return status

    def end_requests(self, reason: str) -> int:
        """A planned stop, once its grace has passed: refuse new requests, and end every one in flight with
        `reason` as its error (each route frames it: an error event and [DONE]). Returns how many ended."""
        self._closing = reason
        return self._loop.end_all(reason)

    async def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return replace(await self._loop.memory(reset_peak), replica=self._replica)

    def check_health(self) -> None:
        """Serve replaces a replica whose engine has stopped (its process died, or its thread ended)."""
        if not self._loop.alive():
            raise RuntimeError(self._unavailable())

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.shutdown()
        export = getattr(self, "_ray_metrics", None)
        if export is not None:
            export.stop()
