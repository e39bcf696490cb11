"""MTP drafting on the rank: the MTP layer's cache follows every step, then the layer chains the next drafts.

After the main forward and the draws, each row of a drafting sequence feeds the MTP layer (the trunk's hidden
state at position t with the token at t + 1: the next input, or the row's own drawn token), which fills the
MTP cache under the sequence's block table. From the row whose drawn token starts the next round, the layer
chains `propose` greedy drafts, feeding back its own output (the residual before `shared_head.norm`).
Drafts only decide what the next round verifies, never a token of the reply.
"""

import time
from collections.abc import Callable

import torch

from deployments.model_rank.forward_batch import ForwardBatch
from deployments.step_plan import MtpWork, Proposal, SeqStep, StepPlan, StepResult


class MtpDrafter:
    def __init__(self, mtp: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.mtp = mtp
        self.block_size = block_size
        self.device = device
        self.work = MtpWork()  # the latest `run`'s passes

    def run(self, plan: StepPlan, batch: ForwardBatch, hidden: torch.Tensor, draws: list[StepResult]
            ) -> dict[int, Proposal]:  # fmt: skip
        """Fill the MTP cache over the drafting sequences' rows and chain their proposals (keyed by plan index)."""
        started = time.perf_counter()
        self.work = MtpWork()
        proposals = self._run(plan, batch, hidden, draws)  # ends on a host read of the drafts: nothing pending
        self.work.seconds = time.perf_counter() - started
        return proposals

    def _run(self, plan: StepPlan, batch: ForwardBatch, hidden: torch.Tensor, draws: list[StepResult]
             ) -> dict[int, Proposal]:  # fmt: skip
        drawn = _drawn_per_seq(plan, draws)
        picked = [i for i, s in enumerate(plan.seqs) if s.mtp]
        rows, next_ids, sub = self._cache_pass_inputs(plan, batch, drawn, picked)
        residual = self._timed(len(rows), lambda: self.mtp.residual(hidden[rows], next_ids, sub))  # [R, H]
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

    def _cache_pass_inputs(self, plan: StepPlan, batch: ForwardBatch, drawn: dict[int, list[int]],
                           picked: list[int]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:  # fmt: skip
        """The flat rows of the picked sequences, the token after each, and their sub-batch."""
        firsts, position = [], 0
        for seq in plan.seqs:
            firsts.append(position)
            position += len(seq.new_token_ids)
        rows: list[int] = []
        next_ids: list[int] = []
        for index in picked:
            seq = plan.seqs[index]
            rows.extend(range(firsts[index], firsts[index] + len(seq.new_token_ids)))
            next_ids.extend(_following_tokens(seq, drawn[index]))
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        sub = ForwardBatch(
            input_ids=batch.input_ids[row_index],
            positions=batch.positions[row_index],
            query_lens=[batch.query_lens[i] for i in picked],
            context_lens=[batch.context_lens[i] for i in picked],
            block_tables=[batch.block_tables[i] for i in picked],
            slot_mapping=batch.slot_mapping[row_index],
            logits_indices=torch.empty(0, dtype=torch.long, device=self.device),
            block_size=batch.block_size,
        )
        return row_index, torch.tensor(next_ids, dtype=torch.long, device=self.device), sub

    def _chain(self, plan: StepPlan, residual: torch.Tensor, starts: list[tuple[int, int, int, int]]
               ) -> dict[int, Proposal]:  # fmt: skip
        """Greedy drafts chained one MTP row per sequence at a time, each within its reserved blocks."""
        bs = self.block_size
        proposals = {index: Proposal(after=pos, last_token=token, token_ids=[]) for index, _, pos, token in starts}
        state = residual[torch.tensor([row for _, row, _, _ in starts], device=self.device)]  # [S, H]
        tokens = self.mtp.greedy_drafts(state).tolist()
        live = [(index, pos) for index, _, pos, _ in starts]
        for step in range(1, max(plan.seqs[i].propose for i, _ in live) + 1):
            for (index, _), token in zip(live, tokens):
                proposals[index].token_ids.append(int(token))
            # Draft step + 1 comes from the MTP row at `after` + step - 1 (the position of draft step - 1,
            # or of the round's last token): it needs a reserved slot.
            carry = [k for k, (index, pos) in enumerate(live)
                     if step < plan.seqs[index].propose and pos + step - 1 < len(plan.seqs[index].block_ids) * bs]
            if not carry:
                break
            keep = torch.tensor(carry, dtype=torch.long, device=self.device)
            live = [live[k] for k in carry]
            positions = [pos + step - 1 for _, pos in live]
            tables = [plan.seqs[index].block_ids for index, _ in live]
            chain = ForwardBatch(
                input_ids=torch.tensor([tokens[k] for k in carry], dtype=torch.long, device=self.device),
                positions=torch.tensor(positions, dtype=torch.long, device=self.device),
                query_lens=[1] * len(live),
                context_lens=[p + 1 for p in positions],
                block_tables=tables,
                slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
                                          dtype=torch.long, device=self.device),  # fmt: skip
                logits_indices=torch.empty(0, dtype=torch.long, device=self.device),
                block_size=bs,
            )
            state = self._timed(len(live), lambda: self.mtp.residual(state[keep], chain.input_ids, chain))  # [S', H]
            tokens = self.mtp.greedy_drafts(state).tolist()
        return proposals

    def _timed(self, rows: int, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One pass of the layer over `rows` rows, timed for the engine's cost model."""
        started = time.perf_counter()
        out = run()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.work.timed.append((rows, time.perf_counter() - started))
        return out


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
