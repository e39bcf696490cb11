"""A step's flat rows on the host, shared by every backend's runner (torch and MLX build their tensors from it).

Sequences are laid out one after another: each new token's id, position and cache slot, and which rows draw.
A sequence with images moves its rotary positions by their shift; a step covering placeholder rows also
gets every row's three multimodal positions (temporal, row, column) and where the image embeddings go.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deployments.messages.replies import PromptLogprobRow
from deployments.messages.step import SeqStep, StepPlan
from deployments.model_rank.host_reads import HostReads, upload
from deployments.model_rank.logprob_rows import LogprobReads, read_figures

PROMPT_ROW_SLICE = 64  # prompt positions whose logits exist at once (bounds [n, V] for long prompts)


@dataclass
class ImageRows:
    """Placeholder rows of one image in a step: they take its embeddings [first, first + count)."""

    row: int  # the flat row of the first of them
    key: str  # the image's StepImage key
    first: int  # the index of that row's placeholder within the image
    count: int


@dataclass
class StepRows:
    """One step's rows as plain lists (built by `step_rows` from the plan)."""

    input_ids: list[int]  # [T] the new tokens, sequence after sequence
    positions: list[int]  # [T] each new token's position in its own sequence
    slots: list[int]  # [T] cache slot (block * block_size + offset) of each new token
    logits_rows: list[int]  # [R] rows whose logits are drawn from: each sequence's last len(draws) rows
    query_lens: list[int]  # [S] new tokens per sequence
    context_lens: list[int]  # [S] tokens of each sequence in the cache after this step
    block_tables: list[list[int]]  # [S][n] each sequence's cache blocks, in order
    # Hybrid models only (empty otherwise): each sequence's state slot and captures, and the copies into
    # state slots due before the forward pass (source slot or ZERO_STATE, destination slot).
    state_slots: list[int] = field(default_factory=list)  # [S]
    state_captures: list[list[tuple[int, int]]] = field(default_factory=list)  # [S]: (row offset, slot)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Steps covering image placeholders only (empty otherwise): [3][T] each row's (temporal, row, column)
    # rotary positions, and the rows the image embeddings replace.
    mrope_positions: list[list[int]] = field(default_factory=list)
    image_rows: list[ImageRows] = field(default_factory=list)


def step_rows(plan: StepPlan, block_size: int) -> StepRows:
    rows = StepRows([], [], [], [], [], [], [])
    hybrid = any(seq.state_slot >= 0 for seq in plan.seqs)
    for seq in plan.seqs:
        start, shift = seq.num_computed, seq.num_computed + seq.rope_delta
        for offset, token in enumerate(seq.new_token_ids):
            pos = start + offset
            rows.input_ids.append(token)
            rows.positions.append(shift + offset)
            rows.slots.append(seq.block_ids[pos // block_size] * block_size + pos % block_size)
        total = len(rows.input_ids)
        if seq.images:
            rows.image_rows.extend(image_rows(seq, total - len(seq.new_token_ids)))
        rows.logits_rows.extend(range(total - len(seq.draws), total))
        rows.query_lens.append(len(seq.new_token_ids))
        rows.context_lens.append(seq.num_computed + len(seq.new_token_ids))
        rows.block_tables.append(seq.block_ids)
        if hybrid:
            rows.state_slots.append(seq.state_slot)
            rows.state_captures.append(list(seq.state_captures))
            if seq.state_from is not None:
                rows.state_copies.append((seq.state_from, seq.state_slot))
    if rows.image_rows:
        rows.mrope_positions = _three_rows(plan, rows)
    return rows


def image_positions(seq: SeqStep) -> list[list[int]]:
    """[3][n] the step's rows' (temporal, row, column) positions (transformers' rope index): text at its
    index plus the shift of the images before it on every axis; a placeholder at its image's start
    position plus its (frame, row, column) within the image's token grid."""
    axes: list[list[int]] = [[], [], []]
    images = sorted(seq.images, key=lambda image: image.offset)
    delta, index = seq.rope_delta, 0
    for pos in range(seq.num_computed, seq.num_computed + len(seq.new_token_ids)):
        while index < len(images) and images[index].end <= pos:
            delta += images[index].position_shift
            index += 1
        image = images[index] if index < len(images) and images[index].offset <= pos else None
        if image is None:
            for axis in axes:
                axis.append(pos + delta)
            continue
        _, height, width = image.token_grid
        base, within = image.offset + delta, pos - image.offset
        axes[0].append(base + within // (height * width))
        axes[1].append(base + within // width % height)
        axes[2].append(base + within % width)
    return axes


def image_rows(seq: SeqStep, first_row: int) -> list[ImageRows]:
    """Where each of the step's images meets its rows."""
    start, end = seq.num_computed, seq.num_computed + len(seq.new_token_ids)
    found = []
    for image in seq.images:
        low, high = max(start, image.offset), min(end, image.end)
        if low < high:
            found.append(ImageRows(first_row + low - start, image.key, low - image.offset, high - low))
    return found


def _three_rows(plan: StepPlan, rows: StepRows) -> list[list[int]]:
    """Every row's three positions: a text sequence's rows repeat their one position on each axis; the
    temporal ones become the rotary positions of the step."""
    three: list[list[int]] = [[], [], []]
    start = 0
    for seq in plan.seqs:
        count = len(seq.new_token_ids)
        axes = image_positions(seq) if seq.images else [rows.positions[start : start + count]] * 3
        for axis in range(3):
            three[axis].extend(axes[axis])
        start += count
    rows.positions = three[0]
    return three


def prompt_logprob_rows(
    plan: StepPlan, logits_of: Callable[[int, int], torch.Tensor]
) -> dict[int, list[PromptLogprobRow]]:
    """Rows at every wanted prompt position (`pending_prompt_rows`, read at once)."""
    reads = HostReads()
    pending = pending_prompt_rows(plan, logits_of, reads)
    reads.fetch()
    return pending.rows()


class PendingPromptRows:
    """The step's prompt rows, registered for its one read; `rows` once it was fetched."""

    def __init__(self) -> None:
        self._slices: list[tuple[int, list[int], int, LogprobReads]] = []  # (sequence, next ids, top, figures)

    def add(self, index: int, next_ids: list[int], top: int, figures: LogprobReads) -> None:
        self._slices.append((index, next_ids, top, figures))

    def rows(self) -> dict[int, list[PromptLogprobRow]]:
        rows: dict[int, list[PromptLogprobRow]] = {}
        for index, next_ids, top, figures in self._slices:
            rows.setdefault(index, []).extend(figures.prompt_rows(next_ids, top))
        return rows


def pending_prompt_rows(
    plan: StepPlan, logits_of: Callable[[int, int], torch.Tensor], reads: HostReads
) -> PendingPromptRows:
    """Rows at every wanted prompt position, a slice at a time (never [T, V] at once), computed where the
    logits are and registered in `reads`.

    `logits_of(first_row, count)` gives float32 logits [count, V] of those flat rows; the lm_head is
    row-invariant, so a row does not depend on the slice it sits in.
    """
    pending = PendingPromptRows()
    start = 0
    for index, seq in enumerate(plan.seqs):
        wanted = seq.prompt_rows
        if wanted is not None and wanted.next_ids:
            first = start + wanted.first
            for at in range(0, len(wanted.next_ids), PROMPT_ROW_SLICE):
                ids = wanted.next_ids[at : at + PROMPT_ROW_SLICE]
                logits = logits_of(first + at, len(ids))
                tokens = upload(ids, torch.int64, logits.device)
                figures, _ = read_figures(logits, tokens, wanted.top, reads, with_rank=True)
                pending.add(index, ids, wanted.top, figures)
        start += len(seq.new_token_ids)
    return pending
