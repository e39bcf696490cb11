"""Drive an Engine synchronously to completion (tests and benchmarks without Ray)."""

from dataclasses import dataclass, field

from deployments.messages.replies import FinishReason, LogprobRow, RequestStats
from deployments.messages.requests import EngineRequest
from deployments.scheduler.engine.core import Engine


@dataclass
class Reply:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    chunks: int = 0
    logprobs: list[LogprobRow] = field(default_factory=list)


def run_to_end(engine: Engine, requests: list[EngineRequest], max_steps: int = 100_000) -> dict[str, Reply]:
    replies = {r.request_id: Reply() for r in requests}
    for request in requests:
        engine.add_request(request)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for chunk in engine.step():
            reply = replies[chunk.request_id]
            reply.token_ids.extend(chunk.token_ids)
            reply.text += chunk.text
            reply.chunks += 1
            reply.logprobs.extend(chunk.logprobs or [])
            if chunk.finished:
                reply.finish_reason, reply.stats = chunk.finish_reason, chunk.stats
    assert not engine.has_work(), "engine did not finish"
    return replies
