"""One request's generation as the routes see it: open upstream, refuse early, stream, finish, log.

`start()` waits for the Scheduler's first item, so a refusal (context, bad prompt) becomes an HTTP 400
before any stream opens. `chunks()` then yields EngineChunks (the first included) and, whatever happens,
writes exactly one finish-log line: `finished` with the reply's figures, `ended reason=client-left` when
the consumer stops early (the upstream request is cancelled, which frees its KV blocks), or
`ended reason=error: ...` when generation fails (raised as GenerationFailed).
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import NoReturn

from ray.exceptions import RayActorError

from deployments.ingress.backend import Backend, Upstream
from deployments.ingress.http.drain import SHUTTING_DOWN
from deployments.ingress.http.errors import APIError, refusal_error
from deployments.ingress.http.finish_log import log_ended, log_finished
from deployments.ingress.usage import ReplySummary, summarise
from deployments.messages.render import ReplyFormat
from deployments.messages.replies import EngineChunk, FinishReason, Refusal
from deployments.messages.requests import EngineRequest
from deployments.messages.status import UpstreamItem

log = logging.getLogger("tensorfold.ingress")
END_READ_TIMEOUT_S = 5.0
_END_READS: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones to its tasks


class GenerationFailed(Exception):
    """Generation broke after it started: HTTP 500, or an error event once a stream is open."""


class Generation:
    def __init__(self, backend: Backend, request: EngineRequest, reply: ReplyFormat | None, engine: str) -> None:
        self.request = request
        self.reply = reply
        self.engine = engine
        self.token_ids: list[int] = []
        self.summary: ReplySummary | None = None  # set when the reply finished normally
        self.finish_reason: str | None = None  # "stop" or "length"
        self._backend = backend
        self._upstream: Upstream | None = None
        self._items: AsyncIterator[UpstreamItem] | None = None
        self._first: EngineChunk | None = None
        self._settled = False  # finished, failed, refused or abandoned: nothing left to close or log

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def start(self) -> None:
        """Open the upstream stream and wait for its first item; refusals raise APIError (nothing logged)."""
        self._upstream = self._backend.stream(self.request)
        self._items = self._upstream.__aiter__()
        try:
            first = await anext(self._items)
        except asyncio.CancelledError:
            await self.close()
            raise
        except StopAsyncIteration:
            self._fail_before_reply("the engine closed the stream without a reply")
        except RayActorError:  # its replica is gone (a lost engine, a stop): Serve is replacing it
            self._fail_before_reply("the model is not serving: its Scheduler replica stopped", 503)
        except Exception as exc:  # a replica that died, a Ray failure: nothing was sent yet
            log.exception("request %s failed before its first token", self.request_id)
            self._fail_before_reply(f"generation failed: {exc}")
        if isinstance(first, Refusal):
            self._settled = True  # the stream ended with its refusal; the route logs `refused`
            self._read_end()
            raise refusal_error(first)
        if first.finished and first.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            # Failed before any token: no stream has opened yet, so this is still an HTTP error (503 when a
            # planned stop ended it while it waited: the client may retry).
            status = 503 if first.error == SHUTTING_DOWN else 500
            self._fail_before_reply(first.error or f"the request ended with {first.finish_reason}", status)
        self._first = first

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens found in the prefix cache, from the first chunk (start() first)."""
        assert self._first is not None, "start() first"
        return self._first.cached_tokens or 0

    async def close(self) -> None:
        """Cancel the request upstream unless it already settled (the client left); idempotent."""
        if self._settled:
            return
        self._settled = True
        if self._upstream is not None:
            try:
                await self._upstream.close()
            except Exception:  # the stream may already be gone; nothing left to cancel
                log.debug("closing upstream of %s failed", self.request_id, exc_info=True)
        self._log_ended("client-left")

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        """Every chunk of the reply; the last one carries finish_reason and stats."""
        assert self._first is not None and self._items is not None, "start() first"
        chunk: EngineChunk = self._first
        try:
            while True:
                self.token_ids.extend(chunk.token_ids)
                if chunk.finished:
                    self._finish(chunk)
                    yield chunk
                    return
                yield chunk
                chunk = await self._next_chunk()
        finally:
            await self.close()  # a no-op unless the consumer left before the reply settled

    async def collect(self) -> tuple[str, list[EngineChunk]]:
        """The whole reply text (for non-streamed responses)."""
        pieces: list[str] = []
        chunks: list[EngineChunk] = []
        async for chunk in self.chunks():
            pieces.append(chunk.text)
            chunks.append(chunk)
        return "".join(pieces), chunks

    async def _next_chunk(self) -> EngineChunk:
        assert self._items is not None
        try:
            item = await anext(self._items)
        except StopAsyncIteration:
            self._fail("the engine closed the stream before the reply finished")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("request %s failed while streaming", self.request_id)
            self._fail(f"generation failed: {exc}")
        if not isinstance(item, EngineChunk):
            self._fail(f"unexpected item from the engine: {type(item).__name__}")
        return item

    def _finish(self, chunk: EngineChunk) -> None:
        if chunk.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or chunk.stats is None:
            self._fail(chunk.error or f"the request ended with {chunk.finish_reason}")
        self._settled = True
        self._read_end()
        self.finish_reason = FinishReason(chunk.finish_reason).value
        self.summary = summarise(self.token_ids, chunk.stats, self.request.sampling, self.reply, self.engine)
        log_finished(self.request_id, self.summary, self.finish_reason, self.summary.reasoning_effort)

    def _read_end(self) -> None:
        """Read the settled stream to its end, in the background: until then Serve (and its router) count
        the request as ongoing at its replica."""
        if self._items is not None and self._upstream is not None:
            task = asyncio.get_running_loop().create_task(_read_end(self._items, self._upstream))
            _END_READS.add(task)
            task.add_done_callback(_END_READS.discard)

    def _fail(self, message: str) -> NoReturn:
        self._settled = True
        self._log_ended(f"error: {message}")
        raise GenerationFailed(message)

    def _fail_before_reply(self, message: str, status: int = 500) -> NoReturn:
        self._settled = True
        self._log_ended(f"error: {message}")
        raise APIError(status, message, "server_error")

    def _log_ended(self, reason: str) -> None:
        log_ended(
            self.request_id, reason, len(self.request.prompt_token_ids), len(self.token_ids), self.request.arrival_time
        )


async def _read_end(items: AsyncIterator[UpstreamItem], upstream: Upstream) -> None:
    try:
        await asyncio.wait_for(anext(items), END_READ_TIMEOUT_S)
    except StopAsyncIteration:
        return
    except Exception:  # gone already, or slow to end: cancelling releases it just the same
        pass
    await upstream.close()  # an item after the last one, or no end in time
