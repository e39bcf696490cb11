"""A finished reply's figures: OpenAI usage, the `tensorfold` runtime block and the token digest.

Definitions (docs/api.md): `seconds` is the reply's decode time, from the end of its prompt pass to its
last token; `tokens_per_second` divides the reply's tokens after the first by it; `prefill_seconds` is
the prompt pass; `time_to_first_token` counts from the request's arrival, so queueing shows there.
`token_sha` is SHA-256 over the reply's token ids (each as 4 little-endian bytes), counting the tokens
through the one that ended the reply, as usage does.
"""

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

from deployments.messages.render import ReplyFormat
from deployments.messages.replies import RequestStats
from deployments.messages.requests import SamplingParams


def token_sha(token_ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}I", *token_ids)).hexdigest()


def reasoning_tokens(token_ids: list[int], reply: ReplyFormat | None) -> int:
    """Thinking tokens, through the closing think marker.

    A reply is thinking from its first token when the prompt opened the think block, or when the reply
    itself opens one as its first token; otherwise it has no reasoning.
    """
    if reply is None or reply.think_closer_id is None or not token_ids:
        return 0
    opened = reply.prompt_opens_thinking or token_ids[0] == reply.think_opener_id
    if not opened:
        return 0
    try:
        return token_ids.index(reply.think_closer_id) + 1
    except ValueError:
        return len(token_ids)  # cut inside its reasoning: every token so far was thinking


@dataclass
class ReplySummary:
    """Everything the response bodies and the finish log say about a finished reply."""

    token_ids: list[int]
    stats: RequestStats
    reasoning_tokens: int
    sha: str
    sampling: SamplingParams
    enable_thinking: bool | None = None
    engine: str = "tensorfold"
    reasoning_effort: str | None = None  # the level the template heard
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def time_to_first_token(self) -> float | None:
        if self.stats.first_token_time is None:
            return None
        return max(0.0, self.stats.first_token_time - self.stats.arrival_time)

    @property
    def tokens_per_second(self) -> float:
        after_first = max(0, self.stats.completion_tokens - 1)
        seconds = self.stats.decode_seconds
        return after_first / seconds if seconds > 0 else 0.0

    def usage(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }

    def runtime_block(self) -> dict[str, Any]:
        stats, sampling = self.stats, self.sampling
        block: dict[str, Any] = {"engine": self.engine}
        if self.enable_thinking is not None:
            block["enable_thinking"] = self.enable_thinking
        ttft = self.time_to_first_token
        block.update(
            tokens_per_second=round(self.tokens_per_second, 2),
            seconds=round(stats.decode_seconds, 6),
            time_to_first_token=None if ttft is None else round(ttft, 6),
            prefill_seconds=round(stats.prefill_seconds, 6),
            prefill_widths=list(stats.prefill_widths),
            sampling={
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "min_p": sampling.min_p,
                "seed": stats.seed,
            },
            token_sha=self.sha,
            rounds=stats.rounds,
            preemptions=stats.preemptions,
            drafts=stats.draft_method,
            drafted=stats.drafted,
            accepted=stats.accepted,
            acceptance_rate=round(stats.acceptance_rate, 4),
            tokens_per_round=round(stats.tokens_per_round, 3),
        )
        block["pocket_version"] = stats.pocket_version  # living weights: the version it was computed with
        if self.reasoning_effort is not None:
            block["reasoning_effort"] = self.reasoning_effort
        if stats.loop_period is not None:  # the loop guard closed the think block
            block["loop"] = {"period": stats.loop_period}
        if stats.replica:  # the Scheduler replica that served it, and why the router chose that one
            block["replica"] = stats.replica
        if stats.route_reason:
            block["route"] = stats.route_reason
        block.update(self.extra)
        return block


def summarise(
    token_ids: list[int], stats: RequestStats, sampling: SamplingParams, reply: ReplyFormat | None, engine: str
) -> ReplySummary:
    return ReplySummary(
        token_ids=list(token_ids),
        stats=stats,
        reasoning_tokens=reasoning_tokens(token_ids, reply),
        sha=token_sha(token_ids),
        sampling=sampling,
        enable_thinking=reply.enable_thinking if reply is not None else None,
        engine=engine,
        reasoning_effort=reply.reasoning_effort if reply is not None else None,
    )
