"""What the Slide room reaches in the graph: the Renderer (render, tokenize), the Scheduler replicas (stream
a request, their statuses, the typed slide calls). In the graph it is `SlideGraphLinks`, over Serve
handles; serve_app/local_backend.py's LocalBackend is the same over an in-process renderer and engine."""

from typing import Protocol

from deployments.engine_client.graph_links import GraphLinks
from deployments.engine_client.streams import Upstream
from deployments.messages.calls import Reply
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.slide import SlideCall
from deployments.messages.status import ReplicaStatus

SLIDE_CALL_TIMEOUT_S = 120.0  # one slide call: a training slice, a staged version, a graph write


class SlideLinks(Protocol):
    async def card(self) -> TokenizerCard: ...

    async def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal: ...

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def stream(self, request: EngineRequest) -> Upstream: ...

    async def replicas(self) -> list[ReplicaStatus]: ...

    async def slide(self, call: SlideCall[Reply]) -> list[Reply]: ...


class SlideGraphLinks(GraphLinks):
    """The Slide replica's links: the Renderer and Scheduler handles, and the slide calls to every replica."""

    async def slide(self, call: SlideCall[Reply]) -> list[Reply]:
        """Every Scheduler replica's answer to a living-weights call, or the named replica's alone (a list of
        one); a replica that fails or does not answer in time raises."""
        response = self._scheduler.broadcast("slide", call)
        results = await response.results_async(timeout_s=SLIDE_CALL_TIMEOUT_S, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise RuntimeError(f"a Scheduler replica failed a slide call: {failures[0]}")
        answers = [r for r in results if r is not None] if call.replica else list(results)
        return [call.reply(answer) for answer in answers]
