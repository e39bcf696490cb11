"""What the HTTP routes need from the rest of the graph, and its implementation over Serve handles.

Routes speak to a `Backend`: render, tokenize, stream one EngineRequest, read replica status, keep stored
responses, run living-weights changes. In the graph it is `GraphBackend` (Renderer, Scheduler, ResponseStore
and, with `--slide`, Slide deployment handles); `local_backend.LocalBackend` runs the same routes over an
in-process renderer, engine loop and Slide room (benchmarks, tests without Ray).
"""

import logging
from typing import Protocol

from ray.serve.handle import DeploymentHandle

from deployments.engine_client.graph_links import STATUS_TIMEOUT_S, GraphLinks
from deployments.engine_client.streams import HandleStream, ItemStream, Upstream, direct
from deployments.messages.memory import ReplicaMemory
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.responses import StoredResponse
from deployments.messages.slide import SlideGraph
from deployments.messages.slide_changes import SlideChange, SlideItem
from deployments.messages.status import ReplicaStatus
from deployments.messages.store import StoreUnavailable

log = logging.getLogger("tensorfold.ingress")


class Backend(Protocol):
    async def card(self) -> TokenizerCard: ...

    async def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal: ...

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]: ...

    async def token_strs(self, ids: list[int]) -> list[str]: ...

    async def detokenize(self, ids: list[int]) -> str: ...

    def stream(self, request: EngineRequest) -> Upstream: ...

    async def replicas(self) -> list[ReplicaStatus]: ...

    async def memory(self, reset_peak: bool = False) -> list[ReplicaMemory]: ...

    async def imprint(self, query: ImprintQuery) -> ImprintAnswer: ...

    async def client_left(self) -> None: ...

    async def forget_disk(self) -> int | StoreUnavailable: ...

    async def end_requests(self, reason: str) -> int: ...

    def slide_change(self, change: SlideChange) -> ItemStream[SlideItem]: ...

    async def slide_graph(self) -> SlideGraph | Refusal: ...

    async def slide_clear(self, owner: str) -> int | Refusal: ...

    async def save_response(self, entry: StoredResponse) -> None: ...

    async def load_response(self, response_id: str) -> StoredResponse | None: ...

    async def delete_response(self, response_id: str) -> bool: ...


class GraphBackend(GraphLinks):
    """The Backend of an Ingress replica: calls into the Renderer, Scheduler, ResponseStore and Slide
    deployments (the Slide room only with `--slide`: without it the routes answer 501 first)."""

    def __init__(
        self,
        renderer: DeploymentHandle,
        scheduler: DeploymentHandle,
        responses: DeploymentHandle,
        slide: DeploymentHandle | None = None,
    ) -> None:
        super().__init__(renderer, scheduler, "ingress")
        self._responses = direct(responses)  # one replica shared by every Ingress
        self._slide = None if slide is None else direct(slide)
        self._slide_change = None if self._slide is None else self._slide.options(stream=True, method_name="change")

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._renderer.token_strs.remote(ids)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._renderer.detokenize.remote(ids)

    async def memory(self, reset_peak: bool = False) -> list[ReplicaMemory]:
        """Every Scheduler replica's memory snapshot (one that does not answer in time is left out)."""
        try:
            response = self._scheduler.broadcast("memory", reset_peak)
            results = await response.results_async(timeout_s=STATUS_TIMEOUT_S, return_exceptions=True)
        except Exception as exc:  # no replica yet, or none answered in time: callers answer 503
            log.warning("no Scheduler replica reported its memory: %s", exc)
            return []
        return [r for r in results if isinstance(r, ReplicaMemory)]

    async def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        return await self._scheduler.imprint.remote(query)  # the router picks its conversation's replica

    async def client_left(self) -> None:
        """A client left its streamed reply: any Scheduler replica counts it (the replicas' counts are summed)."""
        await self._scheduler.client_left.remote()

    async def forget_disk(self) -> int | StoreUnavailable:
        """Every replica forgets its node's set; replicas sharing a node's store free it once. A replica
        whose store did not delete is the answer (the route answers 503)."""
        response = self._scheduler.broadcast("forget_disk")
        results = await response.results_async(timeout_s=60.0, return_exceptions=True)
        refused = [r for r in results if isinstance(r, StoreUnavailable)]
        if refused:
            return refused[0]
        failures = [r for r in results if not isinstance(r, int)]
        if failures:
            raise RuntimeError(f"a Scheduler replica could not forget its states: {failures[0]}")
        return sum(results)

    async def end_requests(self, reason: str) -> int:
        """A planned stop: every Scheduler replica ends its requests with `reason`; returns how many ended."""
        response = self._scheduler.broadcast("end_requests", reason)
        results = await response.results_async(timeout_s=STATUS_TIMEOUT_S, return_exceptions=True)
        return sum(r for r in results if isinstance(r, int))

    def slide_change(self, change: SlideChange) -> ItemStream[SlideItem]:
        return HandleStream[SlideItem](self._slide_room(self._slide_change).remote(change))

    async def slide_graph(self) -> SlideGraph | Refusal:
        return await self._slide_room(self._slide).graph.remote()

    async def slide_clear(self, owner: str) -> int | Refusal:
        return await self._slide_room(self._slide).clear.remote(owner)

    @staticmethod
    def _slide_room(handle: DeploymentHandle | None) -> DeploymentHandle:
        if handle is None:
            raise RuntimeError("this graph has no Slide deployment: the server was started without --slide")
        return handle

    async def save_response(self, entry: StoredResponse) -> None:
        await self._responses.save.remote(entry)

    async def load_response(self, response_id: str) -> StoredResponse | None:
        return await self._responses.load.remote(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return await self._responses.delete.remote(response_id)
