"""The Scheduler deployment: one model copy, a thin Serve wrapper over the engine loop.

The engine runs on its own thread (EngineLoop); this replica's event loop only moves chunks, so streams
and health checks stay responsive. `generate` is an async generator: each item is one coalesced
EngineChunk holding every token ready since the last one (never a Ray call per token); refusals come
as values (see wire.py) before any chunk.

At tensor-parallel size N > 1 the replica sits in a placement group whose bundle i is rank i's (bundle
0 also holds this replica); the engine starts its rank actors in the current placement group.
"""

import os
from dataclasses import fields
from collections.abc import AsyncIterator

from ray import serve

from deployments.config import EngineConfig
from deployments.log_setup import configure_logging
from deployments.scheduler.engine import Engine
from deployments.scheduler.engine_loop import EngineLoop
from deployments.scheduler.memory_report import ReplicaMemory, replica_memory
from deployments.scheduler.ray_metrics import RayMetricsExport
from deployments.scheduler.wire import EngineInfo, ContextRefusal, InvalidPrompt, ReplicaStatus, UpstreamItem
from deployments.types import ContextLengthError, EngineRequest


async def engine_stream(loop: EngineLoop, request: EngineRequest) -> AsyncIterator[UpstreamItem]:
    """The loop's chunks for one request, with refusals (raised before the first chunk) as values."""
    stream = loop.generate(request)
    started = False
    try:
        async for chunk in stream:
            started = True
            yield chunk
    except ContextLengthError as exc:
        yield ContextRefusal.from_error(exc)
    except ValueError as exc:
        if started:
            raise
        yield InvalidPrompt(str(exc), getattr(exc, "param", request.prompt_param))
    finally:
        # A cancelled stream (the client left) closes this generator: closing the engine's iterator aborts
        # the request there, which frees its KV blocks at the next step.
        await stream.aclose()


def replica_status(replica: str, info: EngineInfo) -> ReplicaStatus:
    snapshot = {f.name: getattr(info, f.name) for f in fields(EngineInfo)}
    return ReplicaStatus(**snapshot, replica=replica, memory=_cuda_memory(str(info.device)))


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (constructed directly in-process): the process is the replica
        return f"pid-{os.getpid()}"


def _cuda_memory(device: str) -> dict[str, int]:
    """This process's CUDA memory (the model's at tensor-parallel size 1); {} where it holds no GPU."""
    if not device.startswith("cuda"):
        return {}
    import torch

    if not torch.cuda.is_available():  # tensor-parallel ranks hold the GPUs, not this replica
        return {}
    return {"active": int(torch.cuda.memory_allocated()), "cache": 0, "peak": int(torch.cuda.max_memory_allocated())}


@serve.deployment(name="Scheduler", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=1024)
class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        configure_logging()
        self._engine = Engine(config)
        self._loop = EngineLoop(self._engine)
        self._loop.start()
        self._replica = _replica_tag()
        self._ray_metrics = RayMetricsExport(self._loop.info)  # the readings in Ray's dashboard too

    async def generate(self, request: EngineRequest) -> AsyncIterator[UpstreamItem]:
        stream = engine_stream(self._loop, request)
        try:
            async for item in stream:
                self._ray_metrics.observe(item)
                yield item
        finally:
            await stream.aclose()

    def validate(self, request: EngineRequest) -> ContextRefusal | InvalidPrompt | None:
        try:
            self._engine.validate(request)
        except ContextLengthError as exc:
            return ContextRefusal.from_error(exc)
        except ValueError as exc:
            return InvalidPrompt(str(exc), getattr(exc, "param", request.prompt_param))
        return None

    def info(self) -> ReplicaStatus:
        # The loop's snapshot after its latest step: the engine's own state belongs to its thread.
        return replica_status(self._replica, self._loop.info())

    def memory(self, reset_peak: bool = False) -> ReplicaMemory:
        return replica_memory(self._replica, self._engine, reset_peak)

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.shutdown()
        export = getattr(self, "_ray_metrics", None)
        if export is not None:
            export.stop()
