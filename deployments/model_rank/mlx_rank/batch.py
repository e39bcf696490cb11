"""One MLX step's arrays, built from the shared host layout (`step_rows.StepRows`)."""

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from deployments.model_rank.step_rows import StepRows


@dataclass
class MlxBatch:
    """What the MLX layers read (built by the MLX runner); sequences sit one after another in T."""

    input_ids: mx.array  # [T] int32
    positions: mx.array  # [T] float32: each new token's position, as rotary multiplies it
    slots: mx.array  # [T] int32: cache slot of each new token (the caches are [blocks * block_size, ...])
    spans: list[tuple[int, int]]  # [S] (first, end) rows of each sequence's new tokens
    context_slots: list[mx.array]  # [S] [context] int32: the slots of each sequence's whole context, in order
    # Hybrid models (empty otherwise): each sequence's state slot, and its captures (row offset, slot).
    state_slots: list[int] = field(default_factory=list)  # [S]
    state_captures: list[list[tuple[int, int]]] = field(default_factory=list)  # [S]
    rope: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)  # cos/sin per rotary (its id)
    # Steps over image placeholders only (None otherwise): [3, T] float32 each row's (temporal, row, column)
    # positions; the flat rows [N] int32 whose input embeddings are the images' [N, H] (set by the runner).
    mrope_positions: mx.array | None = None
    image_rows: mx.array | None = None
    image_embeds: mx.array | None = None

    @staticmethod
    def from_rows(rows: StepRows, block_size: int) -> "MlxBatch":
        spans, start = [], 0
        for n in rows.query_lens:
            spans.append((start, start + n))
            start += n
        offsets = np.arange(block_size, dtype=np.int64)
        context_slots = []
        for length, table in zip(rows.context_lens, rows.block_tables):
            blocks = np.asarray(table[: -(-length // block_size)], dtype=np.int64)
            context_slots.append(mx.array((blocks[:, None] * block_size + offsets).reshape(-1)[:length], mx.int32))
        return MlxBatch(
            input_ids=mx.array(rows.input_ids, mx.int32),
            positions=mx.array(rows.positions, mx.float32),
            slots=mx.array(rows.slots, mx.int32),
            spans=spans,
            context_slots=context_slots,
            state_slots=rows.state_slots,
            state_captures=rows.state_captures,
            mrope_positions=mx.array(rows.mrope_positions, mx.float32) if rows.mrope_positions else None,
        )
