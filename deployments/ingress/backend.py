"""What the HTTP routes need from the rest of the graph, and its implementation over Serve handles.

Routes speak to a `Backend`: render, tokenize, stream one EngineRequest, read replica status, keep stored
responses. In the graph it is `GraphBackend` (Renderer, Scheduler and ResponseStore deployment handles);
`local_backend.LocalBackend` runs the same routes over an in-process renderer and engine loop (benchmarks, tests without Ray).
"""

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeVar

from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from deployments.messages.calls import Reply
from deployments.messages.memory import ReplicaMemory
from deployments.messages.render import ChatRenderRequest, RenderedPrompt, TokenizerCard
from deployments.messages.replies import ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.responses import StoredResponse
from deployments.messages.slide import SlideCall
from deployments.messages.status import ReplicaStatus, UpstreamItem
from deployments.messages.store import StoreUnavailable

log = logging.getLogger("tensorfold.ingress")
STATUS_TIMEOUT_S = 5.0
T = TypeVar("T")
SLIDE_CALL_TIMEOUT_S = 120.0  # one slide call: a training slice, a staged version, a graph write


class Upstream(Protocol):
    """One request's stream of items from a Scheduler; `close` cancels the request upstream."""

    def __aiter__(self) -> AsyncIterator[UpstreamItem]: ...

    async def close(self) -> None: ...


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

    async def slide(self, call: SlideCall[Reply]) -> list[Reply]: ...

    async def save_response(self, entry: StoredResponse) -> None: ...

    async def load_response(self, response_id: str) -> StoredResponse | None: ...

    async def delete_response(self, response_id: str) -> bool: ...


async def fan_out(coroutines: list[Coroutine[Any, Any, T]]) -> list[T | BaseException]:
    """Run calls into the graph side by side, each in a context of its own, and return every result (or
    its exception). Inside one request Serve gives every call that request's id, and its router, keeping
    pending calls by id, then routes them one at a time with backoffs (or loses them): concurrent calls made
    for one request need ids of their own."""
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(coroutine, context=_without_serve_request()) for coroutine in coroutines]
    return await asyncio.gather(*tasks, return_exceptions=True)


def _without_serve_request() -> contextvars.Context:
    """This context (the API key's label and the rest) without Serve's request: a call made in it gets ids
    of its own. Serve keeps the request in a private variable of Ray 2.60's (`ray.serve.context`)."""
    context = contextvars.copy_context()
    context.run(serve_context._serve_request_context.set, None)
    return context


class _HandleStream:
    """A Scheduler `generate` stream over Serve; cancelling it cancels the replica's generator."""

    def __init__(self, generator: DeploymentResponseGenerator) -> None:
        self._generator = generator

    def __aiter__(self) -> AsyncIterator[UpstreamItem]:
        return self._generator.__aiter__()

    async def close(self) -> None:
        self._generator.cancel()


class GraphBackend:
    """The Backend of an Ingress replica: calls into the Renderer and Scheduler deployments."""

    def __init__(self, renderer: DeploymentHandle, scheduler: DeploymentHandle, responses: DeploymentHandle) -> None:
        # Calls and streamed chunks go straight to the replica over Serve's gRPC data path, not as Ray object
        # references: a chunk then costs one message instead of an object-store put and a fetch. Everything
        # passed is a class importable by name, so plain pickle serves (cloudpickle, Serve's default, costs
        # several times more per message).
        wire = {"_by_reference": False, "request_serialization": "pickle", "response_serialization": "pickle"}
        self._renderer = renderer.options(**wire)
        self._scheduler = scheduler.options(**wire)
        self._responses = responses.options(**wire)  # one replica shared by every Ingress
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

    async def token_strs(self, ids: list[int]) -> list[str]:
        return await self._renderer.token_strs.remote(ids)

    async def detokenize(self, ids: list[int]) -> str:
        return await self._renderer.detokenize.remote(ids)

    def stream(self, request: EngineRequest) -> Upstream:
        return _HandleStream(self._generate.remote(request))

    async def replicas(self) -> list[ReplicaStatus]:
        """Every Scheduler replica's status (a replica that does not answer in time is left out)."""
        try:
            response = self._scheduler.broadcast("info")
            results = await response.results_async(timeout_s=STATUS_TIMEOUT_S, return_exceptions=True)
        except TimeoutError:
            log.warning("Scheduler replicas did not report their status within %.0f s", STATUS_TIMEOUT_S)
            return []
        except Exception as exc:  # no replica yet (starting) or none left: callers answer 503
            self._no_status(exc)
            return []
        statuses = [r for r in results if isinstance(r, ReplicaStatus)]
        self._answered = self._answered or bool(statuses)
        for failure in (r for r in results if not isinstance(r, ReplicaStatus)):
            log.warning("a Scheduler replica did not report its status: %s", failure)
        return statuses

    def _no_status(self, exc: Exception) -> None:
        """While the model loads this is expected: said once at INFO; after a replica has served, a warning."""
        if self._answered:
            log.warning("no Scheduler replica reported its status: %s", exc)
        elif not self._said_waiting:
            self._said_waiting = True
            log.info("waiting for a Scheduler replica to load the model (%s)", exc)

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

    async def save_response(self, entry: StoredResponse) -> None:
        await self._responses.save.remote(entry)

    async def load_response(self, response_id: str) -> StoredResponse | None:
        return await self._responses.load.remote(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return await self._responses.delete.remote(response_id)
