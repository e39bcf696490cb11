"""One request's state inside the engine: its tokens, how many are computed, its blocks and its output."""

import enum
import time
from dataclasses import dataclass, field

from deployments.messages.replies import EngineChunk, FinishReason, LogprobRow, PromptLogprobRow, RequestStats
from deployments.messages.requests import EngineRequest, Priority
from deployments.messages.step import PromptRowsWanted, SeqDraw
from deployments.scheduler.engine.drafts import DraftState
from deployments.scheduler.engine.grammar import GrammarFailure, ReplyGrammar, allows
from deployments.scheduler.engine.kv_blocks import BlockTable
from deployments.scheduler.engine.state_slots import SeqStates
from deployments.scheduler.engine.text_output import IncrementalText


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted: holds no lane and no blocks
    RUNNING = "running"  # admitted: prefilling until caught up, then decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    request: EngineRequest
    seed: int  # the sampling key (the request's, or derived from the prompt)
    max_tokens: int  # the resolved reply limit
    text: IncrementalText
    arrival_order: int  # tie-breaker: first come, first served
    token_ids: list[int] = field(default_factory=list)  # prompt + reply so far
    num_computed: int = 0  # leading tokens whose KV is in the cache
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SeqStatus = SeqStatus.WAITING
    passed_over: int = 0  # prefill chunks given to other prompts while this one waited for its turn
    delivered: int = 0  # reply tokens already handed to the client
    opened: bool = False  # its first chunk (carrying the cached token count) was sent
    finish_reason: FinishReason | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    prompt_done_time: float | None = None  # when the prompt pass ended (decode time counts from here)
    grammar: ReplyGrammar | None = None  # the reply's matcher, advanced with each accepted token
    logprob_rows: list[LogprobRow] | None = None  # one per reply token when the request asked for logprobs
    scores: list[float] | None = None  # a scoring request's result, set at the end of its prompt pass
    prompt_rows: list[PromptLogprobRow] | None = None  # row j: prompt token j + 1 (prompt_logprobs requests)
    prompt_rows_sent: bool = False  # the rows went out with the first chunk after the prompt pass
    draft: DraftState | None = None  # None: this reply decodes serially (`draft: false`, or no drafter)
    states: SeqStates | None = None  # hybrid models: its state slots while it runs (state_slots.py)
    images_on_rank: set[int] = field(default_factory=set)  # its images whose embeddings the rank holds

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_reply_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reply_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def background(self) -> bool:
        return self.request.priority == Priority.BACKGROUND

    @property
    def tokens_left(self) -> int:
        """Tokens still to compute before the next draw."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """More than one token to catch up: a prompt (or a recomputation after preemption)."""
        return self.tokens_left > 1 or (self.num_reply_tokens == 0 and self.tokens_left > 0)

    def take_chunk(self, final: bool = False) -> EngineChunk | None:
        """The reply's news since the last chunk (None when there is none and it is not the last)."""
        chunk = EngineChunk(
            request_id=self.request_id,
            token_ids=self.reply_token_ids[self.delivered :],
            text=self.text.take_delta(final),
            logprobs=None if self.logprob_rows is None else self.logprob_rows[self.delivered :],
        )
        if self.prompt_rows is not None and not self.prompt_rows_sent:  # whole once the prompt pass ends
            chunk.prompt_logprobs, self.prompt_rows_sent = self.prompt_rows, True
        self.delivered = self.num_reply_tokens
        if not (chunk.token_ids or chunk.text or chunk.prompt_logprobs is not None or final):
            return None
        if not self.opened:
            chunk.cached_tokens, self.opened = self.stats.cached_tokens, True
        return chunk

    def close_stats(self) -> RequestStats:
        """Its figures as it finishes."""
        stats = self.stats
        stats.finish_time = time.time()
        stats.completion_tokens = self.num_reply_tokens
        stats.stop_string = self.text.stopped_by
        if self.prompt_done_time is not None:
            stats.decode_seconds = stats.finish_time - self.prompt_done_time
        return stats

    def prompt_rows_wanted(self, start: int, count: int) -> PromptRowsWanted | None:
        """The rows a step over positions [start, start + count) must bring (none already collected:
        a recomputation after preemption does not repeat them)."""
        if self.prompt_rows is None or self.request.prompt_logprobs is None:
            return None
        first = max(start, len(self.prompt_rows))
        end = min(start + count, self.num_prompt_tokens - 1)  # the last prompt position draws, it has no row
        if first >= end:
            return None
        return PromptRowsWanted(self.request.prompt_logprobs, first - start, self.token_ids[first + 1 : end + 1])

    def next_draw(self, ahead: int = 0) -> SeqDraw:
        """The draw of the reply token `ahead` places past the next one (drafts before it taken as kept:
        the grammar must already stand after them)."""
        s = self.request.sampling
        return SeqDraw(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            seed=self.seed,
            reply_position=self.num_reply_tokens + ahead,
            allowed=None if self.grammar is None else self.grammar.allowed(),
            want_logprobs=self.request.logprobs,
            score_ids=self.request.score_token_ids,
        )

    def verify_draws(self, drafts: list[int]) -> tuple[SeqDraw, list[int], list[SeqDraw]]:
        """The next draw, the drafts the grammar lets through, and each kept draft's row draw.

        Row i's mask is the grammar's state after drafts 1..i; the matcher is walked forward and taken back,
        so it still stands where the written reply leaves it.
        """
        first = self.next_draw()
        if not drafts:
            return first, [], []
        if self.grammar is None:
            return first, drafts, [self.next_draw(i + 1) for i in range(len(drafts))]
        saved = self.grammar.checkpoint()
        kept: list[int] = []
        draws: list[SeqDraw] = []
        mask = first.allowed
        try:
            for token in drafts:
                if mask is None or not allows(mask, token) or self.grammar.terminated:
                    break
                self.grammar.accept(token)
                kept.append(token)
                draws.append(self.next_draw(len(kept)))
                mask = draws[-1].allowed
        except GrammarFailure:
            pass
        finally:
            self.grammar.restore(saved)
        return first, kept, draws
