"""One EngineRequest's reply as a caller reads it from its Scheduler stream.

`open()` waits for the stream's first item: the engine's refusal, or a failure before any token (as a 500,
or a 503 the client may send again: its replica stopped, or a planned stop ended it), comes back as a
`Refusal` before any reply is shown. `chunks()` then yields the EngineChunks (the first included) to the
finish; a stream that breaks after that raises GenerationFailed. A caller that stops reading early closes
it, which cancels the request upstream (its KV blocks are freed). Ingress's routes log each reply's end
through the two hooks (deployments/ingress/generation.py); the Slide room reads its questions' replies as
they are.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import NoReturn

from ray.exceptions import RayActorError

from deployments.engine_client.streams import Upstream
from deployments.messages.replies import SHUTTING_DOWN, EngineChunk, FinishReason, Refusal, RequestStats
from deployments.messages.requests import EngineRequest
from deployments.messages.status import UpstreamItem

log = logging.getLogger("tensorfold.replies")
END_READ_TIMEOUT_S = 5.0
_END_READS: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones to its tasks


class GenerationFailed(Exception):
    """Generation broke after it started: HTTP 500, or an error event once a stream is open."""


class EngineReply:
    def __init__(self, open_stream: Callable[[EngineRequest], Upstream], request: EngineRequest) -> None:
        self.request = request
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" or "length", once the reply finished normally
        self.stats: RequestStats | None = None  # the last chunk's figures, once the reply finished normally
        self._open = open_stream
        self._upstream: Upstream | None = None
        self._items: AsyncIterator[UpstreamItem] | None = None
        self._first: EngineChunk | None = None
        self._settled = False  # finished, failed, refused or abandoned: nothing left to close or log

    @property
    def request_id(self) -> str:
        return self.request.request_id

    # Hooks (no-ops here): what a caller records when the reply ends.
    def _ended(self, reason: str) -> None:
        """The reply ended without finishing: `client-left`, or `error: ...`."""

    def _finished(self, chunk: EngineChunk) -> None:
        """The reply finished normally with `chunk` (token_ids, finish_reason and stats are set)."""

    async def open(self) -> Refusal | None:
        """Open the stream and wait for its first item: None when the reply has begun, else the refusal."""
        self._upstream = self._open(self.request)
        self._items = self._upstream.__aiter__()
        try:
            first = await anext(self._items)
        except asyncio.CancelledError:
            await self.close()
            raise
        except StopAsyncIteration:
            return self._failed_before_reply("the engine closed the stream without a reply")
        except RayActorError:  # its replica is gone (a lost engine, a stop): Serve is replacing it
            return self._failed_before_reply("the model is not serving: its Scheduler replica stopped", 503)
        except Exception as exc:  # a replica that died, a Ray failure: nothing was sent yet
            log.exception("request %s failed before its first token", self.request_id)
            return self._failed_before_reply(f"generation failed: {exc}")
        if isinstance(first, Refusal):
            self._settled = True  # the stream ended with its refusal; the caller reports it
            self._read_end()
            return first
        if first.finished and first.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            # Failed before any token (503 when a planned stop ended it while it waited: the client may retry).
            status = 503 if first.error == SHUTTING_DOWN else 500
            return self._failed_before_reply(first.error or f"the request ended with {first.finish_reason}", status)
        self._first = first
        return None

    async def close(self) -> None:
        """Cancel the request upstream unless it already settled (the reader left); idempotent."""
        if self._settled:
            return
        self._settled = True
        if self._upstream is not None:
            try:
                await self._upstream.close()
            except Exception:  # the stream may already be gone; nothing left to cancel
                log.debug("closing upstream of %s failed", self.request_id, exc_info=True)
        self._ended("client-left")

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        """Every chunk of the reply; the last one carries finish_reason and stats."""
        assert self._first is not None and self._items is not None, "open() first"
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
            await self.close()  # a no-op unless the reader left before the reply settled

    async def collect(self) -> tuple[str, list[EngineChunk]]:
        """The whole reply text, and its chunks."""
        pieces: list[str] = []
        chunks: list[EngineChunk] = []
        async for chunk in self.chunks():
            pieces.append(chunk.text)
            chunks.append(chunk)
        return "".join(pieces), chunks

    @property
    def first_chunk(self) -> EngineChunk:
        assert self._first is not None, "open() first"
        return self._first

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
        self.stats = chunk.stats
        self._finished(chunk)

    def _read_end(self) -> None:
        """Read the settled stream to its end, in the background: until then Serve (and its router) count
        the request as ongoing at its replica."""
        if self._items is not None and self._upstream is not None:
            task = asyncio.get_running_loop().create_task(_read_end(self._items, self._upstream))
            _END_READS.add(task)
            task.add_done_callback(_END_READS.discard)

    def _fail(self, message: str) -> NoReturn:
        self._settled = True
        self._ended(f"error: {message}")
        raise GenerationFailed(message)

    def _failed_before_reply(self, message: str, status: int = 500) -> Refusal:
        self._settled = True
        self._ended(f"error: {message}")
        return Refusal(message, status=status, type="server_error")


async def _read_end(items: AsyncIterator[UpstreamItem], upstream: Upstream) -> None:
    try:
        await asyncio.wait_for(anext(items), END_READ_TIMEOUT_S)
    except StopAsyncIteration:
        return
    except Exception:  # gone already, or slow to end: cancelling releases it just the same
        pass
    await upstream.close()  # an item after the last one, or no end in time
