"""The routes' Backend over an in-process renderer, engine loop and Slide room: the same HTTP surface
without Ray.

Used to measure what the graph adds (`tensorfold bench`) and by tests that need the routes but not Serve.
Everything here is the real renderer, engine and Slide room; only the Ray hops are missing. Like the graph's
Ingress, it may answer before its engine has loaded: built without a loop it reports no replica (the engine
is not ready), and `attach` hands it the engine's running loop once that exists. It is also the Slide
room's links (deployments/slide/links.py): the room renders, streams and makes its slide calls through it,
with the slide settings the engine was opened with.
"""

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Generic, TypeVar

from deployments.chat_format.render_lanes import LanedRendering, RenderLanes
from deployments.chat_format.rendering import PromptRenderer
from deployments.messages.calls import Reply
from deployments.messages.engine_process import ClientLeft, ForgetDisk, Imprint
from deployments.messages.memory import ReplicaMemory
from deployments.messages.render import TokenizerCard
from deployments.messages.replies import ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.responses import StoredResponse
from deployments.messages.slide import SlideCall, SlideGraph
from deployments.messages.slide_changes import SlideChange, SlideItem
from deployments.messages.status import ReplicaStatus, UpstreamItem
from deployments.messages.store import StoreUnavailable
from deployments.response_store.store import ResponseStore
from deployments.scheduler.deployment import engine_stream, replica_status
from deployments.scheduler.transports.thread import EngineLoop
from deployments.slide.room import SlideRoom

Item = TypeVar("Item")


class _LocalStream(Generic[Item]):
    def __init__(self, generator: AsyncIterator[Item]) -> None:
        self._generator = generator

    def __aiter__(self) -> AsyncIterator[Item]:
        return self._generator

    async def close(self) -> None:
        await self._generator.aclose()  # type: ignore[attr-defined]


class LocalBackend(LanedRendering):
    def __init__(self, renderer: PromptRenderer, loop: EngineLoop | None) -> None:
        self._renderer = renderer
        self._loop = loop  # None while the engine loads
        self._responses = ResponseStore()  # one process, so the store lives here
        self._lanes = RenderLanes()  # off the routes' event loop, as the Renderer deployment runs it
        self._slide: SlideRoom | None = None  # made on first use, once the engine (and its settings) exist

    def attach(self, loop: EngineLoop) -> None:
        """The engine has loaded: its running loop serves from now on."""
        self._loop = loop

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise RuntimeError("the engine has not loaded yet")
        return self._loop

    async def card(self) -> TokenizerCard:
        return self._renderer.card()

    def stream(self, request: EngineRequest) -> _LocalStream[UpstreamItem]:
        return _LocalStream(engine_stream(self.loop, request))

    async def replicas(self) -> list[ReplicaStatus]:
        if self._loop is None:  # still loading: no replica answers, as in the graph
            return []
        return [replica_status("local", self._loop.info(), self._loop.memory_figures())]

    async def memory(self, reset_peak: bool = False) -> list[ReplicaMemory]:
        if self._loop is None:
            return []
        return [replace(await self._loop.memory(reset_peak), replica="local")]

    async def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        return await self.loop.ask(Imprint(query))

    async def client_left(self) -> None:
        await self.loop.ask(ClientLeft())

    async def forget_disk(self) -> int | StoreUnavailable:
        return await self.loop.ask(ForgetDisk())

    async def slide(self, call: SlideCall[Reply]) -> list[Reply]:
        """The one engine's answer to a living-weights call (its replica is "local")."""
        if call.replica and call.replica != "local":
            return []
        return [await self.loop.ask(call)]

    @property
    def slide_room(self) -> SlideRoom:
        """The in-process Slide room, over this backend, with the engine's slide settings."""
        if self._slide is None:
            self._slide = SlideRoom(self, self.loop.config)
        return self._slide

    def slide_change(self, change: SlideChange) -> _LocalStream[SlideItem]:
        return _LocalStream(self.slide_room.change(change))

    async def slide_graph(self) -> SlideGraph | Refusal:
        return await self.slide_room.graph()

    async def slide_clear(self, owner: str) -> int | Refusal:
        return await self.slide_room.clear(owner)

    async def end_requests(self, reason: str) -> int:
        return 0 if self._loop is None else self._loop.end_all(reason)

    async def save_response(self, entry: StoredResponse) -> None:
        self._responses.save(entry)

    async def load_response(self, response_id: str) -> StoredResponse | None:
        return self._responses.load(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self._responses.delete(response_id)
