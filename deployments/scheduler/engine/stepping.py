"""One step: plan it (the planner), run it (the executor, on every rank), apply what it drew.

Applying a step moves each row's sequence on through the engine's `Requests`: its computed tokens and full
blocks, its prompt rows, and its draws, written as reply tokens (reply_writer.py) or as a scoring request's
scores, the reply's chunk or its end; then the drafts' bookkeeping and the live rates.
"""

import logging
import time
from dataclasses import dataclass

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import FinishReason
from deployments.messages.step import Proposal, SeqStep, StepOutput, StepResult
from deployments.model_rank.executor import Executor
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.planner import PlannedStep, Planner
from deployments.scheduler.engine.reply_writer import ReplyWriter
from deployments.scheduler.engine.requests import Finish, Requests
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.snapshots import LiveRates
from deployments.scheduler.engine.state_slots import StateSlots

log = logging.getLogger("tensorfold.engine")


@dataclass
class StepRun:
    """What a step ran, for the loop's report and the benchmarks."""

    kind: str  # "prefill" or "decode"
    seconds: float  # planning, the forward pass and applying its output


class StepRunner:
    def __init__(
        self,
        planner: Planner,
        executor: Executor,
        requests: Requests,
        writer: ReplyWriter,
        counters: EngineCounters,
        drafts: DraftRounds | None = None,
        states: StateSlots | None = None,
        disk: DiskStates | None = None,
    ) -> None:
        self.planner = planner
        self.executor = executor
        self.requests = requests  # every change to a request goes through it
        self.writer = writer
        self.counters = counters
        self.drafts = drafts  # None: the engine does not draft
        self.states = states  # hybrid models' state slots (None: an attention-only model)
        self.disk = disk  # None when the store is off
        self.rates = LiveRates()

    def run(self) -> StepRun | None:
        """Plan and run one step (None when nothing could be planned); its chunks wait in `requests`."""
        started = time.perf_counter()
        planned = self.planner.schedule()
        if planned is None:
            return None
        try:
            return self._run(planned, started)
        finally:
            if self.states is not None:
                self.states.step_ran()  # its state copies are done: the snapshots it read may go

    def _run(self, planned: PlannedStep, started: float) -> StepRun:
        executed = time.perf_counter()
        try:
            output = self.executor.execute(planned.plan)
        except Exception as exc:  # one failing step must not take the server down
            log.exception("step failed")
            for seq in planned.seqs:
                self.requests.finish(seq, Finish(FinishReason.ERROR, f"generation failed: {exc}"))
        else:
            seconds = time.perf_counter() - executed
            self.planner.record(planned, seconds)
            self._apply(planned, output, seconds)
            if self.drafts is not None:
                self.drafts.record_step(planned.plan.kind == "decode", planned.plan.num_tokens, seconds, output.mtp)
        return StepRun(planned.plan.kind, time.perf_counter() - started)

    def _apply(self, planned: PlannedStep, output: StepOutput, seconds: float) -> None:
        now = time.time()
        drawn = iter(output.draws)
        is_prefill = planned.plan.kind == "prefill"
        new_tokens = written = 0
        for index, (seq, step) in enumerate(zip(planned.seqs, planned.plan.seqs)):
            results = [next(drawn) for _ in step.draws]
            if seq.prompt_rows is not None:
                seq.prompt_rows.extend(output.prompt_rows.get(index, []))
            self.requests.advance(seq, len(step.new_token_ids) - step.num_drafts)  # a draft counts once kept
            if is_prefill:
                seq.stats.prefill_seconds += seconds
                seq.stats.prefill_widths.append(len(step.new_token_ids))
                new_tokens += len(step.new_token_ids)
            else:
                seq.stats.rounds += 1
            if results:
                written += self._write(seq, step, results, output.proposals.get(index), now)
        for seq, step in zip(planned.seqs, planned.plan.seqs):
            if seq.states is not None:
                self._move_states(seq, step)
        if is_prefill:
            self.rates.prefill_pass(new_tokens, seconds)
            if self.disk is not None:
                self.disk.measured_prefill(new_tokens, seconds)
        else:
            self.counters.rounds_total += 1
            self.rates.decoded(written)

    def _write(
        self, seq: Sequence, step: SeqStep, results: list[StepResult], proposal: Proposal | None, now: float
    ) -> int:
        """A sequence's draws into its reply, and what they end or keep; returns the reply tokens written."""
        if seq.request.score_token_ids is not None:
            self.requests.finish(seq, self.writer.scored(seq, results[0], now))
            return 0
        if seq.max_tokens == 0:
            self.requests.finish(seq, self.writer.prompt_only(seq, now))
            return 0
        before = seq.num_reply_tokens
        run = self.writer.accept_run(seq, step, results, now)
        if run.kept:
            self.requests.advance(seq, run.kept)  # the kept drafts' KV rows are the reply's
        self.requests.wrote(seq, run.finish)
        if self.drafts is not None:
            self.drafts.record(seq, step.num_drafts, run.kept)
            _take_proposal(seq, proposal)
        return seq.num_reply_tokens - before

    def _move_states(self, seq: Sequence, step: SeqStep) -> None:
        """After a hybrid sequence's step: a verify round that kept fewer rows than it computed resumes from
        the last kept row's captured states; the rolling snapshot joins the cache when it is due."""
        assert seq.states is not None and self.states is not None
        kept = seq.num_computed - step.num_computed
        if 0 < kept < len(step.new_token_ids):
            seq.states.restore_from = seq.states.row_slots[kept - 1]
        ends_prompt = step.num_computed < seq.num_prompt_tokens <= seq.num_computed
        self.states.name_if_due(seq.states, seq.token_ids, ends_prompt, seq.request.images)


def _take_proposal(seq: Sequence, proposal: Proposal | None) -> None:
    """Keep the rank's MTP drafts when they continue the reply as written."""
    state = seq.draft
    if state is None or state.method != "mtp":
        return
    fits = (
        proposal is not None
        and seq.finish_reason is None
        and proposal.after == len(seq.token_ids) - 1
        and seq.token_ids[-1] == proposal.last_token
    )
    state.proposed = proposal.token_ids if fits and proposal is not None else []
    state.proposed_after = proposal.after if fits and proposal is not None else -1
