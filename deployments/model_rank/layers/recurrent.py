"""What recurrent layers (Gated DeltaNet, Mamba2) share: a step's rows per sequence as the kernels see them
(`scan_rows`), the slots' pools, and the checkpoint's depthwise conv.

Exactness (docs/engine.md, Hybrid models): a token's state update runs the same ops in the same order
whether it arrives in a prompt chunk of any size, alone in a decode round, or beside other sequences
(kernels/recurrent_scan.py says how). Projections around them stay batched (they are row-invariant).
"""

from typing import Protocol

import torch
from torch import nn

from deployments.model_rank.forward_batch import LayerStateSpec, ParallelContext
from deployments.model_rank.layers.parallel import copy_part_shards, divide
from kernels.recurrent_scan import ScanRows


class SequenceRows(Protocol):
    """What `scan_rows` reads: a ForwardBatch, or the host rows it is built from (step_rows.StepRows)."""

    query_lens: list[int]
    state_slots: list[int]
    state_captures: list[list[tuple[int, int]]]


def scan_rows(batch: SequenceRows) -> ScanRows:
    """The step's sequences (flat rows, state slots, captured rows) for the recurrent kernels."""
    if len(batch.state_slots) != len(batch.query_lens):
        raise RuntimeError("a recurrent layer needs a state slot per sequence")
    starts, ends, captures, start = [], [], [], 0
    for index, count in enumerate(batch.query_lens):
        starts.append(start)
        ends.append(start + count)
        for offset, slot in batch.state_captures[index] if batch.state_captures else []:
            captures.append((start + offset, slot))
        start += count
    return ScanRows(tuple(starts), tuple(ends), tuple(batch.state_slots), tuple(captures))


class RecurrentMixer(nn.Module):
    """A layer whose per-sequence states live in slots of its pools (bound by the runner).

    Subclasses declare `state_spec()` and compute `forward(hidden [T, H], batch) -> [T, H]`, reading each
    sequence's states from its slot (`scan_rows`) and advancing them in place.
    """

    conv_pool: torch.Tensor  # [slots, K - 1, C] in the model's dtype
    state_pool: torch.Tensor  # [slots, ...] float32

    def state_spec(self) -> LayerStateSpec:
        raise NotImplementedError

    def bind_state(self, pool: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.conv_pool, self.state_pool = pool


class DepthwiseConv1d(nn.Module):
    """A recurrent layer's `conv1d` as checkpoints store it: weight [C, 1, K] (and bias [C]).

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
