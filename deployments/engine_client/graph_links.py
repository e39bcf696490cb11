"""The graph's Renderer and Scheduler deployments over Serve handles, as every room that asks them for work
speaks to them: render, tokenize, stream one EngineRequest, read every replica's status."""

import logging

from ray.serve.handle import DeploymentHandle

from deployments.engine_client.streams import HandleStream, Upstream, direct
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.status import ReplicaStatus, UpstreamItem

STATUS_TIMEOUT_S = 5.0


class GraphLinks:
    """Handles to the Renderer and the Scheduler, with the calls every room makes of them."""

    def __init__(self, renderer: DeploymentHandle, scheduler: DeploymentHandle, room: str) -> None:
        self._log = logging.getLogger(f"tensorfold.{room}")  # the calling room's logger
        self._renderer = direct(renderer)
        self._scheduler = direct(scheduler)
        self._answered = False  # a Scheduler replica has reported its status (loading is over)
        self._said_waiting = False  # the one INFO line while the replicas load
        # Built once: options(), and so each method attribute of a handle, allocates a new handle.
        self._generate = self._scheduler.options(stream=True, method_name="generate")
        self._card: TokenizerCard | None = None

    async def card(self) -> TokenizerCard:
        if self._card is None:  # the tokenizer never changes while serving
            self._card = await self._renderer.card.remote()
        return self._card

    async def render_chat(self, request: ChatRenderRequest) -> RenderedPrompt | Refusal:
        return await self._renderer.render_chat.remote(request)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._renderer.tokenize.remote(text, add_special_tokens)

    def stream(self, request: EngineRequest) -> Upstream:
        return HandleStream[UpstreamItem](self._generate.remote(request))

    async def replicas(self) -> list[ReplicaStatus]:
        """Every Scheduler replica's status (a replica that does not answer in time is left out)."""
        try:
            response = self._scheduler.broadcast("info")
            results = await response.results_async(timeout_s=STATUS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            self._log.warning("Scheduler replicas did not report their status within %.0f s", STATUS_TIMEOUT_S)
            return []
        except Exception as exc:  # no replica yet (starting) or none left: callers answer 503
            self._no_status(exc)
            return []
        statuses = [r for r in results if isinstance(r, ReplicaStatus)]
        self._answered = self._answered or bool(statuses)
        for failure in (r for r in results if not isinstance(r, ReplicaStatus)):
            self._log.warning("a Scheduler replica did not report its status: %s", failure)
        return statuses

    def _no_status(self, exc: Exception) -> None:
        """While the model loads this is expected: said once at INFO; after a replica has served, a warning."""
        if self._answered:
            self._log.warning("no Scheduler replica reported its status: %s", exc)
        elif not self._said_waiting:
            self._said_waiting = True
            self._log.info("waiting for a Scheduler replica to load the model (%s)", exc)
