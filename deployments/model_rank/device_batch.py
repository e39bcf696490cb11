"""A step's tensors on the runner's device, built from its host rows before the layers run (docs/engine.md,
The step on a GPU).

Everything the forward pass reads comes from here, sent in one staged copy per dtype (step_upload.py): the
token ids, positions and cache slots, the attention kernels' layout for each row limit the model's layers
use (kernels/paged_meta.py), a hybrid step's recurrent rows (kernels/scan_meta.py), and the block-table
entries that changed (device_tables.py); the step's tables are then gathered on the device. So no layer
copies anything to the device and nothing in the forward pass reads the device back.

A CUDA graph's step (decode_graphs.py) is the same build padded to its bucket: padding rows are one-token
sequences over the sink (a KV block and a state slot no sequence owns), and its fixed-size parts land in
the graph's static buffers, where the captured kernels read them.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deployments.model_rank.device_tables import SINK_ROW, DeviceBlockTables, TableDelta
from deployments.model_rank.forward_batch import ForwardBatch
from deployments.model_rank.layers.recurrent import scan_rows
from deployments.model_rank.step_rows import StepRows
from deployments.model_rank.step_upload import StagedUpload
from kernels import dispatch
from kernels.paged_meta import PagedLayout, aligned_offsets, paged_layout, paged_meta
from kernels.recurrent_scan import ScanRows
from kernels.scan_meta import scan_layout, scan_meta_from

CAPTURES_PER_ROW = 2  # a decode row captures at most its rolling block and one interval snapshot


@dataclass(frozen=True)
class Sink:
    """Where padding rows write: a KV block and a state slot past what the engine hands out."""

    block: int
    slot: int = -1  # -1: the model keeps no states


@dataclass
class StaticStep:
    """A CUDA graph's inputs: device buffers every replay reads, sized for the largest bucket."""

    longs: torch.Tensor  # int64: token ids, positions, cache slots
    ints: torch.Tensor  # int32: the attention layout(s) and the recurrent rows
    tables: torch.Tensor  # [largest bucket, width] int32
    max_row_len: int  # the longest row the graph was captured for (kernels launch a fixed split count)


def pad_rows(rows: StepRows, padding: int, sink: Sink, block_size: int) -> StepRows:
    """`rows` and `padding` one-token sequences over the sink: their rows compute garbage in the sink's
    block and slot, which no sequence reads, and no real row reads theirs (every kernel is row-wise)."""
    hybrid = sink.slot >= 0
    return dataclasses.replace(
        rows,
        input_ids=rows.input_ids + [0] * padding,
        positions=rows.positions + [0] * padding,
        slots=rows.slots + [sink.block * block_size] * padding,
        query_lens=rows.query_lens + [1] * padding,
        context_lens=rows.context_lens + [1] * padding,
        block_tables=rows.block_tables + [[sink.block]] * padding,
        state_slots=rows.state_slots + [sink.slot] * padding if hybrid else [],
        state_captures=rows.state_captures + [[] for _ in range(padding)] if hybrid else [],
    )


def run_forward(forward: Callable[[ForwardBatch], torch.Tensor], batch: ForwardBatch) -> torch.Tensor:
    """A model's forward over a built batch: its recurrent metadata is handed to the kernels first."""
    if batch.scan is not None and batch.scan_rows is not None:
        dispatch.use_scan_meta(batch.scan_rows, batch.scan)
    return forward(batch)


class DeviceBatches:
    """Builds a runner's ForwardBatches; `row_limits`: the attention row limits the model's layers use."""

    def __init__(
        self, device: torch.device, block_size: int, row_limits: tuple[int, ...], table_width: int, sink: Sink
    ) -> None:
        self.device, self.block_size, self.row_limits, self.sink = device, block_size, row_limits, sink
        self.longs = StagedUpload(device, torch.int64)
        self.ints = StagedUpload(device, torch.int32)
        self.tables = DeviceBlockTables(device, table_width, sink.block)

    def build(self, rows: StepRows, padding: int = 0, static: StaticStep | None = None) -> ForwardBatch:
        """The step's batch (`padding` sink rows after its sequences; `static`: a graph's buffers)."""
        padded = pad_rows(rows, padding, self.sink, self.block_size) if padding else rows
        delta = self.tables.place(rows.block_tables)
        layouts = self._layouts(padded, static)
        distinct = list({id(layout): layout for layout in layouts.values()}.values())
        recurrent = scan_rows(padded) if padded.state_slots else None
        longs, ints = self._upload(padded, delta, distinct, recurrent, padding, static)
        self.tables.apply(delta, longs[4], ints[-1])
        tables = self.tables.gather(ints[-2], None if static is None else static.tables[: len(padded.query_lens)])
        total = len(padded.input_ids)
        metas = {id(layout): paged_meta(layout, tables, ints[7 * i : 7 * i + 7]) for i, layout in enumerate(distinct)}
        scan_parts = ints[7 * len(distinct) : 7 * len(distinct) + 5]
        return ForwardBatch(
            input_ids=longs[0],
            positions=longs[1],
            query_lens=padded.query_lens,
            context_lens=padded.context_lens,
            block_tables=padded.block_tables,
            slot_mapping=longs[2],
            logits_indices=longs[3],
            block_size=self.block_size,
            state_slots=padded.state_slots,
            state_captures=padded.state_captures,
            mrope_positions=longs[5].view(3, total) if padded.mrope_positions else None,
            paged={limit: metas[id(layout)] for limit, layout in layouts.items()},
            scan_rows=recurrent,
            scan=None if recurrent is None else scan_meta_from(total, scan_parts),
        )

    def _upload(
        self,
        rows: StepRows,
        delta: TableDelta,
        layouts: list[PagedLayout],
        recurrent: ScanRows | None,
        padding: int,
        static: StaticStep | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every part on the device: int64 (ids, positions, slots | logits rows, table index, mRoPE) and
        int32 (the layouts, the recurrent rows | table rows, table values). A graph's step sends the parts
        before the bar into its static buffers, at the offsets its capture read (capture slots last: their
        count varies)."""
        fixed_longs = [rows.input_ids, rows.positions, rows.slots]
        fixed_ints = [part for layout in layouts for part in layout.parts()]
        fixed_ints += scan_layout(recurrent, len(rows.input_ids)) if recurrent is not None else []
        mrope = [x for axis in rows.mrope_positions for x in axis]
        other_longs = [rows.logits_rows, delta.index, mrope]
        other_ints = [delta.rows + [SINK_ROW] * padding, delta.values]
        if static is None:
            return self.longs.send(fixed_longs + other_longs), self.ints.send(fixed_ints + other_ints)
        longs = self.longs.send(fixed_longs, into=static.longs) + self.longs.send(other_longs)
        return longs, self.ints.send(fixed_ints, into=static.ints) + self.ints.send(other_ints)

    @torch.inference_mode(False)  # the graphs' inputs, written every step
    def static_step(self, rows: int, hybrid: bool, max_row_len: int) -> StaticStep:
        """Buffers for graphs of up to `rows` one-token sequences (the layouts of `build`'s fixed parts)."""
        _, longs = aligned_offsets([rows] * 3)
        scan = [rows, rows, rows, rows + 1, CAPTURES_PER_ROW * rows] if hybrid else []
        _, ints = aligned_offsets([rows] * 7 + scan)
        return StaticStep(
            longs=torch.zeros(longs, dtype=torch.int64, device=self.device),
            ints=torch.zeros(ints, dtype=torch.int32, device=self.device),
            tables=torch.zeros(rows, self.tables.width, dtype=torch.int32, device=self.device),
            max_row_len=max_row_len,
        )

    def _layouts(self, rows: StepRows, static: StaticStep | None) -> dict[int, PagedLayout]:
        """The attention layout per row limit; limits every sequence fits share one (a decode step's do)."""
        longest = max(rows.query_lens, default=0)
        layouts: dict[int, PagedLayout] = {}
        shared = None
        for limit in self.row_limits:
            if longest <= limit and shared is not None:
                layouts[limit] = shared
                continue
            layout = paged_layout(rows.query_lens, rows.context_lens, limit)
            if static is not None:  # the kernels were launched for the graph's longest row
                layout = dataclasses.replace(layout, max_row_len=static.max_row_len)
            layouts[limit] = layout
            if longest <= limit:
                shared = layout
        return layouts
