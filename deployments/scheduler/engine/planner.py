"""The scheduling policy: which prompt chunk or decode round runs next, which request starts and which is
preempted (carried out by the engine's `Requests`, the one owner of the tables).

Policy (docs/engine.md, Scheduling): every admitted prompt prefills a chunk at a time beside
the others; each chunk goes first to a prompt passed over for 8 chunks, then foreground before background,
then the prompt with the fewest tokens left. Running replies take decode rounds between chunks for
`decode_share` of the last chunk's time; `decode_share = 0` prefills every prompt whole first, in arrival
order. When blocks run out, the latest (background first) running sequence is preempted and recomputed.
"""

from dataclasses import dataclass, field

from deployments.messages.step import ZERO_STATE, SeqStep, StepPlan
from deployments.scheduler.engine.draft_rounds import DraftRounds
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.requests import Requests
from deployments.scheduler.engine.seq_images import plan_images
from deployments.scheduler.engine.sequence import SeqStatus, Sequence
from deployments.scheduler.engine.state_slots import StateSlots

PASSED_OVER_LIMIT = 8


@dataclass
class PlannedStep:
    """A step plan with the sequences behind its rows (kept by the engine, never sent to ranks)."""

    plan: StepPlan
    seqs: list[Sequence] = field(default_factory=list)


class Planner:
    def __init__(
        self,
        requests: Requests,
        blocks: BlockManager,
        lanes: int,
        chunk_size: int,
        decode_share: float,
        drafts: DraftRounds | None = None,
        states: StateSlots | None = None,
        spatial_merge: int = 0,
    ) -> None:
        self.requests = requests  # the tables: read here, changed only through their owner
        self.blocks = blocks
        self.spatial_merge = spatial_merge  # patches per image placeholder side (0: no vision tower)
        self.states = states  # hybrid models' state slots (None: an attention-only model)
        self.drafts = drafts  # None: every round decodes one token per sequence
        self.lanes = lanes
        self.chunk_size = chunk_size
        self.decode_share = decode_share
        self.decode_budget = 0.0  # seconds decode rounds may still take before the next chunk

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> PlannedStep | None:
        planned = self._schedule()
        if planned is not None:
            dropped = self.requests.take_dropped_images()
            if dropped:
                planned.plan.drop_images = dropped
        return planned

    def _schedule(self) -> PlannedStep | None:
        self._admit()
        running = self.requests.running
        prefilling = [s for s in running if s.is_prefilling]
        decoding = [s for s in running if not s.is_prefilling]
        chunk_first = bool(prefilling) and (not decoding or self.decode_budget <= 0 or self.decode_share == 0)
        if chunk_first:
            planned = self._plan_chunk(prefilling)
            if planned is not None:
                return planned
        if decoding:
            planned = self._plan_decode(decoding)
            if planned is not None:
                return planned
        if prefilling and not chunk_first:
            return self._plan_chunk(prefilling)
        return None

    def record(self, planned: PlannedStep, seconds: float) -> None:
        """Charge a finished step's time to the decode budget."""
        if planned.plan.kind == "prefill":
            self.decode_budget = self.decode_share * seconds
        else:
            self.decode_budget -= seconds

    # ---- admission ------------------------------------------------------------------------------------
    def _admission_order(self, seq: Sequence) -> tuple[bool, int]:
        return (seq.background, seq.arrival_order)

    def _admit(self) -> None:
        """Start waiting requests while lanes are free (a preempted one waits for the next step)."""
        for head in sorted(self.requests.waiting, key=self._admission_order):
            if len(self.requests.running) >= self.lanes and not self._yield_lane_for(head):
                break
            self.requests.start(head)

    def _yield_lane_for(self, head: Sequence) -> bool:
        """A foreground request takes the lane of the latest background one."""
        if head.background:
            return False
        victims = [s for s in self.requests.running if s.background]
        if not victims:
            return False
        self.requests.preempt(max(victims, key=lambda s: s.arrival_order))
        return True

    # ---- preemption -----------------------------------------------------------------------------------
    def _victim(self, protect: Sequence, planned: list[Sequence]) -> Sequence | None:
        others = [s for s in self.requests.running if s is not protect and s not in planned]
        if not others:
            return None
        return max(others, key=lambda s: (s.background, s.arrival_order))

    def _reserve(self, seq: Sequence, num_tokens: int, planned: list[Sequence]) -> bool:
        """Make `seq`'s blocks cover `num_tokens`, preempting later unplanned work if the pool is short."""
        while not self.blocks.can_grow(seq.block_table, num_tokens):
            victim = self._victim(seq, planned)
            if victim is None or self._ranks_before(victim, seq):
                return False
            self.requests.preempt(victim)
        self.blocks.grow(seq.block_table, num_tokens)
        return True

    @staticmethod
    def _ranks_before(victim: Sequence, seq: Sequence) -> bool:
        """Never preempt work that outranks the sequence asking for room."""
        return (victim.background, victim.arrival_order) < (seq.background, seq.arrival_order)

    # ---- plans ----------------------------------------------------------------------------------------
    def _chunk_order(self, seq: Sequence) -> tuple:
        if self.decode_share == 0:
            return (seq.background, seq.arrival_order)
        starved = seq.passed_over >= PASSED_OVER_LIMIT
        return (not starved, seq.background, seq.tokens_left, seq.arrival_order)

    def _plan_chunk(self, prefilling: list[Sequence]) -> PlannedStep | None:
        planned = PlannedStep(StepPlan(kind="prefill"))
        budget = self.chunk_size
        for seq in sorted(prefilling, key=self._chunk_order):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for a sequence planned before it
            count = min(seq.tokens_left, budget)
            if not self._reserve(seq, seq.num_computed + count, planned.seqs):
                count = self._tokens_that_fit(seq, count)
                if count == 0 or not self._reserve(seq, seq.num_computed + count, planned.seqs):
                    continue
            planned.seqs.append(seq)
            planned.plan.seqs.append(self._seq_step(seq, count))
            budget -= count
        if not planned.seqs:
            return None
        for seq in self.requests.running:
            if seq.is_prefilling:
                seq.passed_over = 0 if seq in planned.seqs else seq.passed_over + 1
        return planned

    def _tokens_that_fit(self, seq: Sequence, wanted: int) -> int:
        room = (len(seq.block_table.block_ids) + self.blocks.num_available) * self.blocks.block_size
        return max(0, min(wanted, room - seq.num_computed))

    def _plan_decode(self, decoding: list[Sequence]) -> PlannedStep | None:
        planned = PlannedStep(StepPlan(kind="decode"))
        offered = self.drafts.for_round(decoding) if self.drafts is not None else {}
        for seq in sorted(decoding, key=lambda s: (s.background, s.arrival_order)):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted to make room for an earlier sequence this round
            if self._reserve(seq, len(seq.token_ids), planned.seqs):
                planned.seqs.append(seq)
        planned.seqs = [seq for seq in planned.seqs if seq.status is SeqStatus.RUNNING]
        # Drafts take free blocks only once every planned row has its own: they never cost anyone a lane.
        for seq in planned.seqs:
            drafts = self._room_for_drafts(seq, offered.get(id(seq), []))
            planned.plan.seqs.append(self._seq_step(seq, seq.tokens_left, drafts, decode=True))
        return planned if planned.seqs else None

    def _room_for_drafts(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """The drafts whose slots (and the next proposal's MTP rows) fit without preempting anyone."""
        if self.drafts is None or seq.draft is None:
            return []
        limit = seq.num_prompt_tokens + seq.max_tokens
        wanted = min(limit, len(seq.token_ids) + len(drafts) + max(self.drafts.to_propose(seq, True) - 1, 0))
        while drafts and not self.blocks.can_grow(seq.block_table, wanted):
            drafts = drafts[:-1]
            wanted = min(limit, len(seq.token_ids) + len(drafts))
        if self.blocks.can_grow(seq.block_table, wanted):
            self.blocks.grow(seq.block_table, wanted)
        return drafts

    def _seq_step(self, seq: Sequence, count: int, drafts: list[int] | None = None, decode: bool = False) -> SeqStep:
        start = seq.num_computed
        reaches_end = start + count == len(seq.token_ids)
        step = SeqStep(
            new_token_ids=seq.token_ids[start : start + count],
            num_computed=start,
            block_ids=[],
            prompt_rows=seq.prompt_rows_wanted(start, count),
            pocket_version=seq.stats.pocket_version,
            capture=seq.request.capture,
        )
        if reaches_end:
            step.draw, kept, step.draft_draws = seq.verify_draws(drafts or [])
            step.new_token_ids += kept
        else:
            step.next_token_id = seq.token_ids[start + count]
        if self.drafts is not None and self.drafts.mtp_rows(seq):
            step.mtp = True
            step.propose = self.drafts.to_propose(seq, decode) if reaches_end else 0
        step.block_ids = list(seq.block_table.block_ids)  # after any growth for drafts
        if seq.request.images:
            plan_images(seq, step, count, self.spatial_merge)
        if seq.states is not None:
            self._plan_states(seq, step, count)
        return step

    def _plan_states(self, seq: Sequence, step: SeqStep, count: int) -> None:
        """The step's state slot, the copy due before it, and its captures: the rolling slot takes the last
        block boundary its first `count` rows reach; a verify round keeps every row's states but the last."""
        states = seq.states
        assert states is not None and self.states is not None
        step.state_slot, step.state_from, states.restore_from = states.running, states.restore_from, None
        if step.state_from is not None and step.state_from != ZERO_STATE:
            self.states.pinned.add(step.state_from)
        boundary = (step.num_computed + count) // self.blocks.block_size * self.blocks.block_size
        for tokens in self.states.interval_points(step.num_computed, boundary, states.named_tokens):
            slot = self.states.take()  # a free slot, else the least recently used snapshot's
            if slot is None:
                break
            step.state_captures.append((tokens - step.num_computed - 1, slot))
            states.interval_slots.append((tokens, slot))
        if boundary > step.num_computed and states.rolling is not None:
            step.state_captures.append((boundary - step.num_computed - 1, states.rolling))
            states.rolling_tokens = boundary
        for row in range(count - 1, len(step.new_token_ids) - 1):  # rows a later row's rejection may return to
            slot = states.row_slots.get(row)
            if slot is None:
                slot = states.row_slots[row] = self.states.take()
            if slot is not None:
                step.state_captures.append((row, slot))
