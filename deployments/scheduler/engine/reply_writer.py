"""Writing replies: each drawn token (or what replaces it) into its sequence, the text and rows it brings,
and where the reply ends, reported as a `Finish` for the engine's `Requests` to carry out.

A token goes through the same checks whether it came alone or in a drafted run: a forced think close,
end tokens and stop ids, stop strings, the reply limit, then the grammar. The first cut ends the run.
"""

from dataclasses import dataclass

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import FinishReason, LogprobRow
from deployments.messages.step import SeqStep, StepResult
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.grammar import GrammarFailure
from deployments.scheduler.engine.requests import Finish
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.thinking import Forced, force_tokens


@dataclass
class Written:
    """What a step's draws did to one reply."""

    kept: int  # drafts kept: their KV rows are the reply's
    finish: Finish | None  # the reply ends here (None: it goes on)


class ReplyWriter:
    """Writes drawn tokens into replies and reports where they end (one writer per engine); the request's
    place in the engine's tables is `Requests`' to change."""

    def __init__(self, eos_ids: set[int], counters: EngineCounters) -> None:
        self.eos_ids = eos_ids  # the tokenizer's and the checkpoint's end ids
        self.counters = counters

    def accept_run(self, seq: Sequence, step: SeqStep, results: list[StepResult], now: float) -> Written:
        """Write the round's draws in order while each kept the draft after it.

        Each token goes through what a serial round does (forced closes, end tokens, stop strings, the
        limit, the grammar), so the first cut ends the run.
        """
        drafts = step.new_token_ids[len(step.new_token_ids) - step.num_drafts :] if step.num_drafts else []
        DraftRounds.count_round(seq, len(drafts))
        kept = 0
        for i, result in enumerate(results):
            if i > 0:  # draft i equalled draw i - 1: its KV row is the reply's
                DraftRounds.count_kept(seq, kept)
                kept += 1
            before = seq.num_reply_tokens
            if seq.logprob_rows is not None and result.logprobs is not None:
                seq.logprob_rows.append(result.logprobs)
            as_drawn, finish = self._accept(seq, result.token, now)
            if finish is None:  # the matcher follows every written token, forced too
                failure = follow_written(seq, before)
                finish = None if failure is None else Finish(FinishReason.ERROR, failure)
            if finish is not None or not as_drawn or i == len(drafts) or result.token != drafts[i]:
                return Written(kept, finish)
        return Written(kept, None)

    @staticmethod
    def scored(seq: Sequence, result: StepResult, now: float) -> Finish:
        """A scoring request ends with its prompt pass: the drawn token is dropped, no reply token is written."""
        seq.prompt_done_time = now
        if result.scores is None:
            return Finish(FinishReason.ERROR, "the model rank returned no scores")
        seq.scores = result.scores
        return Finish(FinishReason.STOP)

    @staticmethod
    def prompt_only(seq: Sequence, now: float) -> Finish:
        """The prompt pass was the whole request (a reply limit of 0: an echo scoring its prompt)."""
        seq.prompt_done_time = now
        return Finish(FinishReason.LENGTH)

    def _accept(self, seq: Sequence, token: int, now: float) -> tuple[bool, Finish | None]:
        """Write a drawn token (or what replaces it): whether it was written as drawn, and the reply's end."""
        if seq.num_reply_tokens == 0:
            seq.stats.first_token_time = now
            seq.prompt_done_time = now
        forced = force_tokens(seq.reply_token_ids, token, seq.request.thinking)
        if forced is not None:  # a thinking budget or the loop guard closes the think block
            return False, self._write_forced(seq, forced)
        seq.token_ids.append(token)
        self.counters.completion_tokens_total += 1
        sampling = seq.request.sampling
        if token in sampling.stop_token_ids or (token in self.eos_ids and not sampling.ignore_eos):
            seq.text.flush_pending()
            return False, Finish(FinishReason.STOP)
        seq.text.add_token(token)
        return True, self._cut(seq)

    def _write_forced(self, seq: Sequence, forced: Forced) -> Finish | None:
        """The forced close joins the reply like drawn tokens; the next step computes its KV."""
        if forced.loop_period is not None:
            seq.stats.loop_period = forced.loop_period
        for token in forced.token_ids:
            seq.token_ids.append(token)
            self.counters.completion_tokens_total += 1
            seq.text.add_token(token)
            finish = self._cut(seq)
            if finish is not None:
                return finish
        return None

    @staticmethod
    def _cut(seq: Sequence) -> Finish | None:
        """A stop string or the reply limit, after a token joined the text."""
        if seq.text.stopped_by is not None:
            return Finish(FinishReason.STOP)
        if seq.num_reply_tokens >= seq.max_tokens:
            seq.text.flush_pending()
            return Finish(FinishReason.LENGTH)
        return None


def follow_written(seq: Sequence, before: int) -> str | None:
    """After a draw was written (or replaced by forced tokens) and the reply goes on: keep one logprob row
    per reply token and advance the grammar over every token written since `before`; returns an error
    message or None."""
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
