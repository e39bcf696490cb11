"""One step: plan it (the planner), run it (the executor, on every rank), apply what it drew.

Applying a step moves each row's sequence on: its computed tokens and full blocks, its prompt rows, and
its draws, written as reply tokens (reply_writer.py) or as a scoring request's scores; then the drafts'
bookkeeping and the live rates.
"""

import logging
import time
from dataclasses import dataclass

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import FinishReason
from deployments.messages.step import Proposal, SeqStep, StepOutput
from deployments.model_rank.executor import Executor
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.planner import PlannedStep, Planner
from deployments.scheduler.engine.reply_writer import ReplyWriter
from deployments.scheduler.engine.sequence import Sequence
from deployments.scheduler.engine.stats import LiveRates

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
        blocks: BlockManager,
        writer: ReplyWriter,
        drafts: DraftRounds | None,
        counters: EngineCounters,
        disk: DiskStates | None,
    ) -> None:
        self.planner = planner
        self.executor = executor
        self.blocks = blocks
        self.writer = writer
        self.drafts = drafts  # None: the engine does not draft
        self.counters = counters
        self.disk = disk  # None when the store is off
        self.rates = LiveRates()

    def run(self) -> StepRun | None:
        """Plan and run one step (None when nothing could be planned); its chunks wait in the writer."""
        started = time.perf_counter()
        planned = self.planner.schedule()
        if planned is None:
            return None
        try:
            return self._run(planned, started)
        finally:
            if self.planner.states is not None:
                self.planner.states.step_ran()  # its state copies are done: the snapshots it read may go

    def _run(self, planned: PlannedStep, started: float) -> StepRun:
        executed = time.perf_counter()
        try:
            output = self.executor.execute(planned.plan)
        except Exception as exc:  # one failing step must not take the server down
            log.exception("step failed")
            for seq in planned.seqs:
                self.writer.finish(seq, FinishReason.ERROR, f"generation failed: {exc}")
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
            seq.num_computed += len(step.new_token_ids) - step.num_drafts  # a draft's KV counts once it is kept
            self.blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed, seq.request.images)
            if is_prefill:
                seq.stats.prefill_seconds += seconds
                seq.stats.prefill_widths.append(len(step.new_token_ids))
                new_tokens += len(step.new_token_ids)
            else:
                seq.stats.rounds += 1
            if not results:
                continue
            if seq.request.score_token_ids is not None:
                self.writer.scored(seq, results[0], now)
                continue
            if seq.max_tokens == 0:
                self.writer.prompt_only(seq, now)
                continue
            before = seq.num_reply_tokens
            kept = self.writer.accept_run(seq, step, results, now)
            written += seq.num_reply_tokens - before
            if self.drafts is not None:
                self.drafts.record(seq, step.num_drafts, kept)
                _take_proposal(seq, output.proposals.get(index))
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

    def _move_states(self, seq: Sequence, step: SeqStep) -> None:
        """After a hybrid sequence's step: a verify round that kept fewer rows than it computed resumes from
        the last kept row's captured states; the rolling snapshot joins the cache when it is due."""
        assert seq.states is not None and self.planner.states is not None
        kept = seq.num_computed - step.num_computed
        if 0 < kept < len(step.new_token_ids):
            seq.states.restore_from = seq.states.row_slots[kept - 1]
        ends_prompt = step.num_computed < seq.num_prompt_tokens <= seq.num_computed
        self.planner.states.name_if_due(seq.states, seq.token_ids, ends_prompt, seq.request.images)


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
