"""What the MLX recurrent mixers (gated_delta.py, mamba2.py here) share, as layers/recurrent.py has it for
torch: a step's rows per sequence, the causal conv over a slot's last inputs, and the state slot pools.

Exactness (docs/engine.md, Hybrid models): every sequence runs on its own, token after token, on
fixed-shape float32 arrays, and the conv is summed tap by tap, so a token's bits do not depend on the chunk
or batch it arrives in. The pools are MLX arrays written by slot (a write replaces the array's contents).
"""

from dataclasses import dataclass, field

import mlx.core as mx

from deployments.model_rank.mlx_rank.batch import MlxBatch


@dataclass
class SequenceRows:
    """One sequence's share of a step, as a recurrent layer sees it."""

    start: int  # first row in the flat token dimension
    end: int  # one past its last row
    slot: int  # the state slot holding its states before this step (advanced by the step)
    captures: dict[int, list[int]] = field(default_factory=dict)  # row offset -> slots given the states after it


def sequence_rows(batch: MlxBatch) -> list[SequenceRows]:
    """The step's sequences in order, with their state slots and captures."""
    if len(batch.state_slots) != len(batch.spans):
        raise RuntimeError("recurrent layers need a state slot per sequence (a hybrid step plan)")
    rows = []
    for index, (start, end) in enumerate(batch.spans):
        captures: dict[int, list[int]] = {}
        for offset, slot in batch.state_captures[index] if batch.state_captures else []:
            captures.setdefault(offset, []).append(slot)
        rows.append(SequenceRows(start, end, batch.state_slots[index], captures))
    return rows


def causal_conv(x: mx.array, history: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """The depthwise causal conv of `x` [T, C] after `history` [K - 1, C], `weight` [C, K]: [T, C] float32,
    each output the taps summed oldest first."""
    inputs = mx.concatenate([history.astype(x.dtype), x]).astype(mx.float32)  # [K - 1 + T, C]
    kernel, count = weight.shape[1], x.shape[0]
    taps = weight.astype(mx.float32)
    out = inputs[0:count] * taps[:, 0]  # [T, C]
    for tap in range(1, kernel):
        out = out + inputs[tap : tap + count] * taps[:, tap]
    return out if bias is None else out + bias.astype(mx.float32)


def history_after(history: mx.array, x: mx.array, row: int) -> mx.array:
    """The K - 1 inputs ending at `row` of `x` [T, C], following `history` [K - 1, C]: [K - 1, C]."""
    width = history.shape[0]
    return mx.concatenate([history.astype(x.dtype), x[: row + 1]])[-width:] if width else history


class RecurrentMixer:
    """An MLX layer whose per-sequence states live in slots of its two pools (allocated by the runner):
    conv [slots, K - 1, C] in the model's dtype, state [slots, ...] float32."""

    conv_pool: mx.array
    state_pool: mx.array

    def bind_state(self, conv_pool: mx.array, state_pool: mx.array) -> None:
        self.conv_pool, self.state_pool = conv_pool, state_pool

    def pools(self) -> list[mx.array]:
        return [self.conv_pool, self.state_pool]

    def store(self, slot: int, history: mx.array, state: mx.array) -> None:
        self.conv_pool[slot] = history.astype(self.conv_pool.dtype)
        self.state_pool[slot] = state

    def capture(self, seq: SequenceRows, row: int, history: mx.array, state: mx.array) -> None:
        """Copy the states after `row` to the slots that asked for them."""
        for slot in seq.captures.get(row, ()):
            self.store(slot, history, state)

    def copy_slot(self, source: int | None, destination: int) -> None:
        """`destination` takes `source`'s states (None: zeroed states)."""
        for pool in self.pools():
            pool[destination] = mx.zeros(pool.shape[1:], pool.dtype) if source is None else pool[source]
