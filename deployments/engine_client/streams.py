"""Streams a room reads from another deployment, and the settings every handle between rooms uses."""

from collections.abc import AsyncIterator
from typing import Generic, Protocol, TypeVar

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments.messages.status import UpstreamItem

Item = TypeVar("Item", covariant=True)
Streamed = TypeVar("Streamed")

# Calls and streamed items go straight to the replica over Serve's gRPC data path, not as Ray object
# references: an item then costs one message instead of an object-store put and a fetch. Everything passed
# is a class importable by name, so plain pickle serves (cloudpickle, Serve's default, costs several times
# more per message).
WIRE = {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}


def direct(handle: DeploymentHandle) -> DeploymentHandle:
    """`handle` with the wire settings above."""
    return handle.options(**WIRE)


class ItemStream(Protocol[Item]):
    """A stream of items from another deployment; `close` cancels the call that makes them there."""

    def __aiter__(self) -> AsyncIterator[Item]: ...

    async def close(self) -> None: ...


Upstream = ItemStream[UpstreamItem]  # one EngineRequest's items from a Scheduler replica


class HandleStream(Generic[Streamed]):
    """A streaming handle call's items; cancelling it cancels the replica's generator."""

    def __init__(self, generator: DeploymentResponseGenerator) -> None:
        self._generator = generator

    def __aiter__(self) -> AsyncIterator[Streamed]:
        return self._generator.__aiter__()

    async def close(self) -> None:
        self._generator.cancel()
