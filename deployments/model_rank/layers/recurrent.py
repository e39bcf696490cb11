"""What recurrent layers (Gated DeltaNet, Mamba2) share: a step's rows per sequence, the causal conv over a
slot's last inputs, and the states a slot holds, read, advanced and captured.

Exactness (docs/engine.md, Hybrid models): a token's state update runs the same ops in the same order
whether it arrives in a prompt chunk of any size, alone in a decode round, or beside other sequences. So
every sequence is computed on its own, token after token (the recurrent form, in float32), and the conv is
elementwise over the kernel's taps. Projections around them stay batched (they are row-invariant).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerStateSpec, ParallelContext
from deployments.model_rank.layers.parallel import copy_part_shards, divide


@dataclass
class SequenceRows:
    """One sequence's share of a step, as a recurrent layer sees it."""

    start: int  # first row in the flat token dimension
    end: int  # one past its last row
    slot: int  # the state slot holding its states before this step (advanced in place)
    captures: dict[int, list[int]] = field(default_factory=dict)  # row offset -> slots given the states after it


def sequence_rows(batch: ForwardBatch) -> list[SequenceRows]:
    """The step's sequences in order, with their state slots and captures."""
    rows, start = [], 0
    for index, count in enumerate(batch.query_lens):
        captures: dict[int, list[int]] = {}
        for offset, slot in batch.state_captures[index] if batch.state_captures else []:
            captures.setdefault(offset, []).append(slot)
        rows.append(SequenceRows(start, start + count, batch.state_slots[index], captures))
        start += count
    return rows


def causal_conv(
    x: torch.Tensor, history: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The depthwise causal conv of `x` [T, C] after `history` [K - 1, C] (the inputs just before it), with
    `weight` [C, K]: [T, C] float32, each output the taps summed oldest first."""
    inputs = torch.cat([history.to(x.dtype), x])  # [K - 1 + T, C]
    kernel, count = weight.shape[1], x.shape[0]
    out = inputs[0:count].float() * weight[:, 0].float()  # [T, C]
    for tap in range(1, kernel):
        out = out + inputs[tap : tap + count].float() * weight[:, tap].float()
    return out if bias is None else out + bias.float()


def history_after(history: torch.Tensor, x: torch.Tensor, row: int) -> torch.Tensor:
    """The K - 1 inputs ending at `row` of `x` [T, C], following `history` [K - 1, C]: [K - 1, C]."""
    width = history.shape[0]
    return torch.cat([history.to(x.dtype), x[: row + 1]])[-width:] if width else history


class RecurrentMixer(nn.Module):
    """A layer whose per-sequence states live in slots of its pools (bound by the runner).

    Subclasses declare `state_spec()` and compute `forward(hidden [T, H], batch) -> [T, H]`, reading each
    sequence's states from `batch.state_slots` (`sequence_rows`), advancing them in place and handing the
    states after a captured row to `capture`.
    """

    conv_pool: torch.Tensor  # [slots, K - 1, C] in the model's dtype
    state_pool: torch.Tensor  # [slots, ...] float32

    def state_spec(self) -> LayerStateSpec:
        raise NotImplementedError

    def bind_state(self, pool: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv_pool, self.state_pool = pool

    def capture(self, seq: SequenceRows, row: int, history: torch.Tensor, state: torch.Tensor) -> None:
        """Copy the states after `row` to the slots that asked for them."""
        for slot in seq.captures.get(row, ()):
            self.conv_pool[slot].copy_(history)
            self.state_pool[slot].copy_(state)


class DepthwiseConv1d(nn.Module):
    """A recurrent layer's `conv1d` as checkpoints store it: weight [C, 1, K] (and bias [C]), applied to a
    sequence's new inputs after its slot's history through `causal_conv`.

    `parts`: the channel blocks laid end to end (Gated DeltaNet's q | k | v, Mamba2's x | B | C); under tensor
    parallelism a rank holds its shard of each block, matching its shard of the input projection.
    """

    def __init__(self, parts: tuple[int, ...], kernel: int, parallel: ParallelContext, bias: bool = False) -> None:
        super().__init__()
        self.parts, self.parallel = parts, parallel
        channels = sum(divide(part, parallel.tp_size, "conv channels") for part in parts)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.weight.weight_loader = self._load_channels
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(channels), requires_grad=False)
            self.bias.weight_loader = self._load_channels

    def _load_channels(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        copy_part_shards(param, loaded, self.parts, self.parallel.tp_rank, self.parallel.tp_size)

    @property
    def history_len(self) -> int:
        """How many past inputs a slot keeps for the next tokens (kernel - 1)."""
        return self.weight.shape[2] - 1

    def forward(self, x: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """x [T, C] after history [K - 1, C] -> [T, C] float32."""
        return causal_conv(x, history, self.weight[:, 0], self.bias)
