"""The Slide deployment: living weights' workflows (docs/slide.md), a thin Serve wrapper over `SlideRoom`.

One replica: a change is a long conversation with every Scheduler replica (the lock, training, staging and
committing versions), and the lock itself lives on those replicas, so one replica is enough and a lost one
loses nothing but the change it was running (its lock's lease ends). It is in the graph only when the
server runs with `--slide` (serve_app/app.py).
"""

from collections.abc import AsyncIterator
from contextlib import aclosing

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.config import SlideSettings
from deployments.log_setup import configure_logging
from deployments.messages.replies import Refusal
from deployments.messages.slide import SlideGraph
from deployments.messages.slide_changes import SlideChange, SlideItem
from deployments.serve_sockets import configure_serve_sockets
from deployments.slide.links import SlideGraphLinks
from deployments.slide.room import SlideRoom


@serve.deployment(name="Slide", num_replicas=1, ray_actor_options={"num_cpus": 0.05}, max_ongoing_requests=64)
class Slide:
    def __init__(self, renderer: DeploymentHandle, scheduler: DeploymentHandle, settings: SlideSettings) -> None:
        configure_logging()  # the room's lines: a failed change, a fact left unsettled
        configure_serve_sockets()  # before Serve binds this replica's gRPC server
        self._room = SlideRoom(SlideGraphLinks(renderer, scheduler, "slide"), settings)

    async def change(self, request: SlideChange) -> AsyncIterator[SlideItem]:
        """A learn or a delete (called with stream=True): its refusal, or ChangeStarted and its events. A
        caller that cancels the stream ends the change, and its lock is released."""
        async with aclosing(self._room.change(request)) as items:
            async for item in items:
                yield item

    async def graph(self) -> SlideGraph | Refusal:
        return await self._room.graph()

    async def clear(self, owner: str) -> int | Refusal:
        return await self._room.clear(owner)
