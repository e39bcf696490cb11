"""Writing replies: each drawn token (or what replaces it) into its sequence, the text and rows it brings,
the end of the reply, and the chunk that carries them out.

A token goes through the same checks whether it came alone or in a drafted run: a forced think close,
end tokens and stop ids, stop strings, the reply limit, then the grammar. The first cut ends the run.
"""

import time
from collections import deque

from deployments.config import EngineConfig
from deployments.messages.counters import EngineCounters
from deployments.messages.replies import EngineChunk, FinishReason, LogprobRow
from deployments.messages.step import SeqStep, StepResult
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.grammar import GrammarFailure
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.planner import Planner
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.thinking import Forced, force_tokens


class ReplyWriter:
    """Writes replies into sequences and queues their chunks (one writer per engine)."""

    def __init__(
        self,
        config: EngineConfig,
        eos_ids: set[int],
        blocks: BlockManager,
        planner: Planner,
        counters: EngineCounters,
        in_flight: dict[str, Sequence],
        disk: DiskStates | None,
    ) -> None:
        self.config = config
        self.eos_ids = eos_ids  # the tokenizer's and the checkpoint's end ids
        self.blocks = blocks
        self.planner = planner
        self.counters = counters
        self.in_flight = in_flight  # the engine's table of admitted requests: a finished one leaves it
        self.disk = disk  # None when the store is off
        self.outbox: deque[EngineChunk] = deque()  # chunks written since the engine last took them

    def take_chunks(self) -> list[EngineChunk]:
        chunks = list(self.outbox)
        self.outbox.clear()
        return chunks

    def accept_run(self, seq: Sequence, step: SeqStep, results: list[StepResult], now: float) -> int:
        """Write the round's draws in order while each kept the draft after it; returns the drafts kept.

        Each token goes through what a serial round does (forced closes, end tokens, stop strings, the
        limit, the grammar), so the first cut ends the run; the reply is sent once, after it.
        """
        drafts = step.new_token_ids[len(step.new_token_ids) - step.num_drafts :] if step.num_drafts else []
        DraftRounds.count_round(seq, len(drafts))
        kept = 0
        for i, result in enumerate(results):
            if i > 0:  # draft i equalled draw i - 1: its KV row is the reply's
                DraftRounds.count_kept(seq, kept)
                kept += 1
                seq.num_computed += 1
                self.blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            before = seq.num_reply_tokens
            if seq.logprob_rows is not None and result.logprobs is not None:
                seq.logprob_rows.append(result.logprobs)
            as_drawn = self._accept(seq, result.token, now)
            failure = follow_written(seq, before)  # the matcher follows every written token, forced too
            if failure is not None:
                self.finish(seq, FinishReason.ERROR, failure)
                break
            if not as_drawn or i == len(drafts) or result.token != drafts[i]:
                break
        if seq.finish_reason is None:
            self._emit(seq)
        return kept

    def scored(self, seq: Sequence, result: StepResult, now: float) -> None:
        """A scoring request ends with its prompt pass: the drawn token is dropped, no reply token is written."""
        seq.prompt_done_time = now
        if result.scores is None:
            self.finish(seq, FinishReason.ERROR, "the model rank returned no scores")
            return
        seq.scores = result.scores
        self.finish(seq, FinishReason.STOP)

    def prompt_only(self, seq: Sequence, now: float) -> None:
        """The prompt pass was the whole request (a reply limit of 0: an echo scoring its prompt)."""
        seq.prompt_done_time = now
        self.finish(seq, FinishReason.LENGTH)

    def _accept(self, seq: Sequence, token: int, now: float) -> bool:
        """Write a drawn token (or what replaces it); True when it was written as drawn and the reply goes on."""
        if seq.num_reply_tokens == 0:
            seq.stats.first_token_time = now
            seq.prompt_done_time = now
        forced = force_tokens(seq.reply_token_ids, token, seq.request.thinking)
        if forced is not None:  # a thinking budget or the loop guard closes the think block
            self._write_forced(seq, forced)
            return False
        seq.token_ids.append(token)
        self.counters.completion_tokens_total += 1
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids or (token in self.eos_ids and not sampling.ignore_eos):
            seq.text.flush_pending()
            self.finish(seq, FinishReason.STOP)
            return False
        seq.text.add_token(token)
        if seq.text.stopped_by is not None:
            self.finish(seq, FinishReason.STOP)
        elif seq.num_reply_tokens >= seq.max_tokens:
            seq.text.flush_pending()
            self.finish(seq, FinishReason.LENGTH)
        return seq.finish_reason is None

    def _write_forced(self, seq: Sequence, forced: Forced) -> None:
        """The forced close joins the reply like drawn tokens; the next step computes its KV."""
        if forced.loop_period is not None:
            seq.stats.loop_period = forced.loop_period
        for token in forced.token_ids:
            seq.token_ids.append(token)
            self.counters.completion_tokens_total += 1
            seq.text.add_token(token)
            if seq.text.stopped_by is not None:
                self.finish(seq, FinishReason.STOP)
                return
            if seq.num_reply_tokens >= seq.max_tokens:
                seq.text.flush_pending()
                self.finish(seq, FinishReason.LENGTH)
                return

    def _emit(self, seq: Sequence, final: bool = False) -> None:
        chunk = EngineChunk(
            request_id=seq.request_id,
            token_ids=seq.reply_token_ids[seq.delivered :],
            text=seq.text.take_delta(final),
            logprobs=None if seq.logprob_rows is None else seq.logprob_rows[seq.delivered :],
        )
        if seq.prompt_rows is not None and not seq.prompt_rows_sent:  # whole once the prompt pass ends
            chunk.prompt_logprobs, seq.prompt_rows_sent = seq.prompt_rows, True
        seq.delivered = seq.num_reply_tokens
        if chunk.token_ids or chunk.text or chunk.prompt_logprobs is not None or final:
            if not seq.opened:
                chunk.cached_tokens, seq.opened = seq.stats.cached_tokens, True
            self.outbox.append(chunk)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """End the reply (once): free its blocks, keep its state for disk, count it, send its last chunk."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if (
            seq.states is not None
            and self.planner.states is not None
            and reason in (FinishReason.STOP, FinishReason.LENGTH)
        ):  # the next turn resumes here (named first: the disk store keeps it with the blocks)
            self.planner.states.name_if_due(seq.states, seq.token_ids, now=True)
        if self.disk is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            chain = self.blocks.resident_chain(seq.block_table)  # before its blocks are released
            if not self.config.learn_conversations:  # --learn: only the prefix it shared with earlier requests
                chain = chain[: seq.stats.cached_tokens // self.config.block_size]
            self.disk.remember(chain)
        self.planner.remove(seq)
        self.in_flight.pop(seq.request_id, None)
        stats = seq.stats
        stats.finish_time = time.time()
        stats.completion_tokens = seq.num_reply_tokens
        stats.stop_string = seq.text.stopped_by
        if seq.prompt_done_time is not None:
            stats.decode_seconds = stats.finish_time - seq.prompt_done_time
        self.counters.finished(stats, reason, seq.request.key_label, departure_counted=seq.request.streamed)
        self._emit(seq, final=True)
        last = self.outbox[-1]
        last.finish_reason, last.error, last.stats = reason, error, stats
        last.scores = seq.scores


def follow_written(seq: Sequence, before: int) -> str | None:
    """After a draw was written (or replaced by forced tokens): keep one logprob row per reply token and
    advance the grammar over every token written since `before`; returns an error message or None."""
    if seq.finish_reason is not None:
        return None
    written = seq.reply_token_ids[before:]
    rows = seq.logprob_rows
    if rows is not None and len(rows) != seq.num_reply_tokens:
        # A forced think close replaced the drawn token: placeholder rows, inside the think block (never shown).
        del rows[before:]
        rows.extend(LogprobRow(token_id=t, logprob=0.0) for t in written)
    if seq.grammar is None:
        return None
    try:
        for token in written:
            seq.grammar.accept(token)
    except GrammarFailure as exc:
        return str(exc)
    return None
