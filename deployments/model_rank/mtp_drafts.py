"""MTP drafting on the rank: the MTP layer's cache follows every step, then the layer chains the next drafts.

After the main forward and the draws, each row of a drafting sequence feeds the MTP layer (the trunk's hidden
state at position t with the token at t + 1: the next input, or the row's own drawn token), which fills the
MTP cache under the sequence's block table. From the row whose drawn token starts the next round, the layer
chains `propose` greedy drafts, feeding back its own output (the residual before `shared_head.norm`).
Drafts only decide what the next round verifies, never a token of the reply.

The bookkeeping here is plain Python over the step's host rows; each backend (torch, MLX) supplies `MtpOps`.
Which rows chain, their positions and slots are known on the host; the drafted ids stay on the device, each
pass fed the last one's, and are read once, after the last pass (docs/engine.md, The step on a GPU).
"""

import time
from typing import Any, Protocol

from deployments.messages.step import MtpWork, Proposal, SeqStep, StepPlan, StepResult
from deployments.model_rank.step_rows import StepRows


class MtpOps(Protocol):
    """What a backend's MTP layer does for the drafter (arrays are that backend's tensors, on its device)."""

    def batch(self, rows: StepRows) -> Any: ...  # the backend's step batch over these rows

    def ids(self, values: list[int]) -> Any: ...  # host ids as an array

    def take(self, array: Any, rows: list[int]) -> Any: ...  # array[rows]

    def residual(self, hidden: Any, next_ids: Any, batch: Any) -> Any: ...  # [R, H]: the layer's output

    def greedy(self, residual: Any) -> Any: ...  # [R]: the likeliest next token of each row (not read)

    def read(self, arrays: list[Any]) -> list[list[int]]: ...  # the arrays' values: one host read for all

    def mark(self, after: Any) -> Any: ...  # a point in the backend's work, after `after` (None: now)

    def seconds(self, start: Any, end: Any) -> float: ...  # between two marks


class MtpDrafter:
    def __init__(self, ops: MtpOps, block_size: int) -> None:
        self.ops = ops
        self.block_size = block_size
        self.work = MtpWork()  # the latest `run`'s passes
        self.marks: list[tuple[int, Any, Any]] = []  # (rows, start, end) of each pass of the latest run

    def run(self, plan: StepPlan, rows: StepRows, hidden: Any, draws: list[StepResult]) -> dict[int, Proposal]:
        """Fill the MTP cache over the drafting sequences' rows and chain their proposals (keyed by plan index)."""
        started = time.perf_counter()
        self.marks = []
        proposals = self._run(plan, rows, hidden, draws)
        # The passes' times (a GPU's pending work is waited for here when no draft was read).
        self.work = MtpWork(timed=[(count, self.ops.seconds(start, end)) for count, start, end in self.marks])
        self.work.seconds = time.perf_counter() - started
        return proposals

    def _run(self, plan: StepPlan, rows: StepRows, hidden: Any, draws: list[StepResult]) -> dict[int, Proposal]:
        drawn = _drawn_per_seq(plan, draws)
        picked = [i for i, s in enumerate(plan.seqs) if s.mtp]
        flat, next_ids, sub = _cache_pass_inputs(plan, rows, drawn, picked)
        residual = self._timed(
            len(flat),
            lambda: self.ops.residual(self.ops.take(hidden, flat), self.ops.ids(next_ids), self.ops.batch(sub)),
        )
        starts: list[tuple[int, int, int, int]] = []  # (plan index, row in residual, position, token there)
        offset = 0
        for index in picked:
            seq = plan.seqs[index]
            tokens = drawn[index]
            if seq.propose > 0 and tokens:
                kept = _kept_drafts(seq, tokens)
                local = len(seq.new_token_ids) - len(tokens) + kept  # the row whose draw starts the next round
                starts.append((index, offset + local, seq.num_computed + local + 1, tokens[kept]))
            offset += len(seq.new_token_ids)
        if not starts:
            return {}
        return self._chain(plan, residual, starts)

    def _chain(self, plan: StepPlan, residual: Any, starts: list[tuple[int, int, int, int]]) -> dict[int, Proposal]:
        """Greedy drafts chained one MTP row per sequence at a time, each within its reserved blocks; the
        drafts stay on the device until all are drafted."""
        proposals = {index: Proposal(after=pos, last_token=token, token_ids=[]) for index, _, pos, token in starts}
        state = self.ops.take(residual, [row for _, row, _, _ in starts])  # [S, H]
        live = [(index, pos) for index, _, pos, _ in starts]
        drafted = [([index for index, _ in live], self.ops.greedy(state))]  # (plan indices, their drafts)
        for step in range(1, max(plan.seqs[i].propose for i, _ in live) + 1):
            carry = self._carried(plan, live, step)
            if not carry:
                break
            live = [live[k] for k in carry]
            chain = self._chain_rows(plan, live, step)
            kept_state, kept_ids = self.ops.take(state, carry), self.ops.take(drafted[-1][1], carry)
            state = self._timed(len(live), lambda: self.ops.residual(kept_state, kept_ids, self.ops.batch(chain)))
            drafted.append(([index for index, _ in live], self.ops.greedy(state)))
        for (indices, _), values in zip(drafted, self.ops.read([ids for _, ids in drafted])):
            for index, token in zip(indices, values):
                proposals[index].token_ids.append(int(token))
        return proposals

    def _carried(self, plan: StepPlan, live: list[tuple[int, int]], step: int) -> list[int]:
        """Which live rows draft again: draft step + 1 comes from the MTP row at `after` + step - 1 (the
        position of draft step - 1, or of the round's last token), which needs a reserved slot."""
        bs = self.block_size
        return [
            k
            for k, (index, pos) in enumerate(live)
            if step < plan.seqs[index].propose and pos + step - 1 < len(plan.seqs[index].block_ids) * bs
        ]

    def _chain_rows(self, plan: StepPlan, live: list[tuple[int, int]], step: int) -> StepRows:
        """One MTP row per live sequence at `after` + step - 1 (its input id comes from the device)."""
        bs = self.block_size
        positions = [pos + step - 1 for _, pos in live]
        tables = [plan.seqs[index].block_ids for index, _ in live]
        return StepRows(
            input_ids=[0] * len(live),  # unread: the layer embeds the drafted ids it is given
            positions=positions,
            slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
            logits_rows=[],
            query_lens=[1] * len(live),
            context_lens=[p + 1 for p in positions],
            block_tables=tables,
        )

    def _timed(self, rows: int, run: Any) -> Any:
        """One pass of the layer over `rows` rows, marked for the engine's cost model (read after the run)."""
        start = self.ops.mark(None)
        out = run()
        self.marks.append((rows, start, self.ops.mark(out)))
        return out


def _cache_pass_inputs(
    plan: StepPlan, rows: StepRows, drawn: dict[int, list[int]], picked: list[int]
) -> tuple[list[int], list[int], StepRows]:
    """The flat rows of the picked sequences, the token after each, and their sub-step's rows."""
    firsts, position = [], 0
    for seq in plan.seqs:
        firsts.append(position)
        position += len(seq.new_token_ids)
    flat: list[int] = []
    next_ids: list[int] = []
    for index in picked:
        seq = plan.seqs[index]
        flat.extend(range(firsts[index], firsts[index] + len(seq.new_token_ids)))
        next_ids.extend(_following_tokens(seq, drawn[index]))
    sub = StepRows(
        input_ids=[rows.input_ids[r] for r in flat],
        positions=[rows.positions[r] for r in flat],
        slots=[rows.slots[r] for r in flat],
        logits_rows=[],
        query_lens=[rows.query_lens[i] for i in picked],
        context_lens=[rows.context_lens[i] for i in picked],
        block_tables=[rows.block_tables[i] for i in picked],
    )
    return flat, next_ids, sub


def _drawn_per_seq(plan: StepPlan, draws: list[StepResult]) -> dict[int, list[int]]:
    """Each sequence's drawn tokens, in row order (draws come flat, in plan order)."""
    drawn: dict[int, list[int]] = {}
    cursor = 0
    for index, seq in enumerate(plan.seqs):
        count = len(seq.draws)
        drawn[index] = [r.token for r in draws[cursor : cursor + count]]
        cursor += count
    return drawn


def _kept_drafts(seq: SeqStep, tokens: list[int]) -> int:
    """Leading drafts equal to the token drawn at the row before them (what the engine keeps, barring a cut)."""
    drafts = seq.new_token_ids[len(seq.new_token_ids) - seq.num_drafts :] if seq.num_drafts else []
    kept = 0
    while kept < len(drafts) and drafts[kept] == tokens[kept]:
        kept += 1
    return kept


def _following_tokens(seq: SeqStep, tokens: list[int]) -> list[int]:
    """The token after each row of the step: a drawing row's own draw, else the next input token."""
    new = seq.new_token_ids
    first_drawn = len(new) - len(tokens)
    after = [new[r + 1] if r + 1 < len(new) else (seq.next_token_id or 0) for r in range(first_drawn)]
    return after + tokens
