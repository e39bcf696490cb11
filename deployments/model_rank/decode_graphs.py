"""Decode steps as CUDA graphs, one per batch-size bucket (docs/engine.md, The step on a GPU).

A decode step launches every layer's kernels from Python, about 19 per dense layer at 9-13 microseconds of
host time each: a graph replays them all in one launch. At startup, after the kernels are warm, the runner
captures the forward pass of a batch of one-token sequences for each bucket (1, 2, 4, 8, then every 8 up to
the lanes), largest first so that the smaller graphs share its memory pool. A step whose sequences all take
one token runs in the smallest bucket that holds them: its batch is built padded to the bucket
(device_batch.py) into the graphs' static buffers, and the bucket's graph replays. Padding rows are
sequences over the sink: every kernel computes a row from that row alone, so they change no real row's
bits. Prefill, drafts being verified, image steps and anything past the largest bucket run eagerly.

The capture is the only CUDA-only part: `CudaGraphCapture` records the forward pass, `EagerReplay` (CPU,
tests) runs it again at every replay over the same static buffers, so the bucketing, padding and buffers
run everywhere.
"""

from collections.abc import Callable
from typing import Protocol

import torch

from deployments.model_rank.device_batch import CAPTURES_PER_ROW, DeviceBatches, StaticStep, run_forward
from deployments.model_rank.forward_batch import ForwardBatch
from deployments.model_rank.step_rows import StepRows

Replay = Callable[[], torch.Tensor]  # runs a captured forward pass: the hidden states [bucket, H]


class Capture(Protocol):
    def capture(self, forward: Replay) -> Replay: ...


class CudaGraphCapture:
    """Records a forward pass as a CUDA graph (after one eager run, which compiles and allocates)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # every bucket's graph allocates from one pool

    def capture(self, forward: Replay) -> Replay:
        side = torch.cuda.Stream()  # the warm run on a side stream, as torch's CUDA graph notes ask
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerReplay:
    """Where no graph can be captured (CPU): a replay runs the forward pass again, over the static buffers."""

    def capture(self, forward: Replay) -> Replay:
        return forward


def buckets_for(lanes: int) -> list[int]:
    """1, 2, 4, 8, then every 8 below the lanes, and the lanes."""
    small = [size for size in (1, 2, 4, 8) if size < lanes]
    return [*small, *range(16, lanes, 8), lanes]


class DecodeGraphs:
    """The runner's decode graphs; `reset_sink` zeroes the sink's recurrent states (hybrid models)."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        batches: DeviceBatches,
        lanes: int,
        static: StaticStep,
        capture: Capture,
        reset_sink: Callable[[], None] | None = None,
    ) -> None:
        self.forward, self.batches, self.static, self.reset_sink = forward, batches, static, reset_sink
        self.buckets = buckets_for(lanes)
        self.current: dict[int, ForwardBatch] = {}  # each bucket's latest batch (over the static buffers)
        self.replays: dict[int, Replay] = {}
        empty = StepRows([], [], [], [], [], [], [], state_slots=[], state_captures=[])
        for bucket in reversed(self.buckets):
            self.current[bucket] = batches.build(empty, padding=bucket, static=static)
            self.replays[bucket] = capture.capture(self._forward_of(bucket))

    def _forward_of(self, bucket: int) -> Replay:
        def forward() -> torch.Tensor:
            if self.reset_sink is not None:
                self.reset_sink()  # padding rows start from zeroed states every replay
            return run_forward(self.forward, self.current[bucket])

        return forward

    def bucket(self, sequences: int) -> int:
        return next(size for size in self.buckets if size >= sequences)

    def holds(self, rows: StepRows) -> bool:
        """Whether a graph can run this step: one token per sequence, no more sequences than the largest
        bucket, no image rows, the tables' width captured, captures within the static room."""
        sequences = len(rows.query_lens)
        return (
            0 < sequences <= self.buckets[-1]
            and all(q == 1 for q in rows.query_lens)
            and not rows.mrope_positions
            and not rows.image_rows
            and self.batches.tables.width == self.static.tables.shape[1]  # no table outgrew the graphs
            and max(map(len, rows.block_tables)) <= self.static.tables.shape[1]
            and sum(map(len, rows.state_captures)) <= CAPTURES_PER_ROW * self.bucket(sequences)
        )

    def run(self, rows: StepRows) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's batch (padded to its bucket) and the hidden states [bucket, H] of the replay."""
        bucket = self.bucket(len(rows.query_lens))
        batch = self.batches.build(rows, padding=bucket - len(rows.query_lens), static=self.static)
        self.current[bucket] = batch
        return batch, self.replays[bucket]()
