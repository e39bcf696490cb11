"""One request's generation as the routes see it: open upstream, refuse early, stream, finish, log.

The reply is read by `EngineReply` (deployments/engine_client/engine_reply.py); this adds what HTTP needs.
`start()` waits for the Scheduler's first item, so a refusal (context, bad prompt) becomes an HTTP 400
before any stream opens. `chunks()` then yields EngineChunks (the first included) and, whatever happens,
writes exactly one finish-log line: `finished` with the reply's figures, `ended reason=client-left` when
the consumer stops early (the upstream request is cancelled, which frees its KV blocks), or
`ended reason=error: ...` when generation fails (raised as GenerationFailed).
"""

from deployments.engine_client.engine_reply import EngineReply
from deployments.ingress.backend import Backend
from deployments.ingress.http.errors import refusal_error
from deployments.ingress.http.finish_log import log_ended, log_finished
from deployments.ingress.usage import ReplySummary, summarise
from deployments.messages.render import ReplyFormat
from deployments.messages.replies import EngineChunk
from deployments.messages.requests import EngineRequest


class Generation(EngineReply):
    def __init__(self, backend: Backend, request: EngineRequest, reply: ReplyFormat | None, engine: str) -> None:
        super().__init__(backend.stream, request)
        self.reply = reply
        self.engine = engine
        self.summary: ReplySummary | None = None  # set when the reply finished normally

    async def start(self) -> None:
        """Open the upstream stream and wait for its first item; refusals raise APIError (nothing logged)."""
        refused = await self.open()
        if refused is not None:
            raise refusal_error(refused)

    @property
    def cached_tokens(self) -> int:
        """The prompt tokens found in the prefix cache, from the first chunk (start() first)."""
        return self.first_chunk.cached_tokens or 0

    def _finished(self, chunk: EngineChunk) -> None:
        assert self.stats is not None and self.finish_reason is not None
        self.summary = summarise(self.token_ids, self.stats, self.request.sampling, self.reply, self.engine)
        log_finished(self.request_id, self.summary, self.finish_reason, self.summary.reasoning_effort)

    def _ended(self, reason: str) -> None:
        log_ended(
            self.request_id, reason, len(self.request.prompt_token_ids), len(self.token_ids), self.request.arrival_time
        )
