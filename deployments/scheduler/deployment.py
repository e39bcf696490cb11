"""The Scheduler deployment: one model copy, a thin Serve wrapper over the engine loop.

The engine runs on its own thread (EngineLoop); this replica's event loop only moves chunks, so streams
and health checks stay responsive. `generate` is an async generator: each item is one coalesced
EngineChunk holding every token ready since the last one (never a Ray call per token). A context
refusal is yielded as a `ContextRefusal` value instead of raised, because ContextLengthError does not
survive pickling (its constructor takes four arguments) and Ingress must answer it before any stream.

At tensor-parallel size N > 1 the replica sits in a placement group whose bundle i is rank i's (bundle
0 also holds this replica); the engine starts its rank actors in the current placement group.
"""

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray import serve

from deployments.config import EngineConfig
from deployments.scheduler.engine import Engine, EngineInfo
from deployments.scheduler.engine_loop import EngineLoop
from deployments.types import ContextLengthError, EngineChunk, EngineRequest


@dataclass
class ContextRefusal:
    """A request that cannot fit the window: what the `context_length_exceeded` error needs."""

    window: int
    prompt_tokens: int
    requested: int | None
    param: str

    @classmethod
    def from_error(cls, exc: ContextLengthError) -> "ContextRefusal":
        return cls(window=exc.window, prompt_tokens=exc.prompt_tokens, requested=exc.requested, param=exc.param)

    def to_error(self) -> ContextLengthError:
        return ContextLengthError(self.window, self.prompt_tokens, self.requested, self.param)


@dataclass
class InvalidPrompt:
    """A prompt the engine cannot run (empty, or an id outside the vocabulary): HTTP 400."""

    message: str
    param: str


@dataclass
class ReplicaStatus:
    """One Scheduler replica's figures for /health (summed over replicas by Ingress)."""

    replica: str  # Serve's replica id, so a caller can tell the model copies apart
    info: EngineInfo
    memory: dict[str, int] = field(default_factory=dict)  # CUDA: active, cache, peak bytes; {} elsewhere


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (a test constructing the class directly): the process is the replica
        return f"pid-{os.getpid()}"


def _cuda_memory(device: str) -> dict[str, int]:
    if not device.startswith("cuda"):
        return {}
    import torch

    return {
        "active": int(torch.cuda.memory_allocated()),
        "cache": 0,
        "peak": int(torch.cuda.max_memory_allocated()),
    }


@serve.deployment(name="Scheduler", ray_actor_options={"num_cpus": 0.2}, max_ongoing_requests=1024)
class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self._engine = Engine(config)
        self._loop = EngineLoop(self._engine)
        self._loop.start()
        self._replica = _replica_tag()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk | ContextRefusal | InvalidPrompt]:
        stream = self._loop.generate(request)
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
            yield InvalidPrompt(str(exc), request.prompt_param)
        finally:
            # A cancelled Serve stream (client gone) closes this generator: closing the engine's iterator
            # aborts the request there, which frees its KV blocks at the next step.
            close = getattr(stream, "aclose", None)
            if close is not None:
                await asyncio.shield(close())

    def validate(self, request: EngineRequest) -> ContextRefusal | InvalidPrompt | None:
        try:
            self._engine.validate(request)
        except ContextLengthError as exc:
            return ContextRefusal.from_error(exc)
        except ValueError as exc:
            return InvalidPrompt(str(exc), request.prompt_param)
        return None

    def info(self) -> ReplicaStatus:
        info = self._loop.info()  # the snapshot after the latest step: the engine's state is its thread's
        return ReplicaStatus(replica=self._replica, info=info, memory=_cuda_memory(str(info.device)))

    def window(self) -> int:
        return self._engine.window

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.shutdown()
