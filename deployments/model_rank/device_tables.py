"""Every running sequence's block table kept on the device across steps (docs/engine.md, The step on a GPU).

A step's plan carries each sequence's whole block list; sending all of them every step would copy
sequences x blocks integers per step. Instead each sequence keeps a row of one device table [rows, width]:
a step finds the row already holding the sequence's table (the one its position held last step, else any
whose entries it extends), uploads only the entries that differ (a decode step: one new block every 16
tokens, else nothing) and gathers its sequences' rows on the device. The host keeps a mirror of each row
to compare against. Row 0 is the sink's: padding rows of a CUDA graph's batch read the sink block there.
"""

from dataclasses import dataclass, field

import torch

from kernels.paged_meta import ALIGN

SINK_ROW = 0


@dataclass
class TableDelta:
    """What one step changes: each sequence's row, and the entries to write (flat index, block id)."""

    rows: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)


def _agreeing(row: list[int], table: list[int]) -> int:
    """How many leading entries `row` and `table` share."""
    common = min(len(row), len(table))
    if row[:common] == table[:common]:
        return common
    return next(i for i in range(common) if row[i] != table[i])


class DeviceBlockTables:
    # The table is kept across steps: allocated as a normal tensor, written inside and outside inference mode.
    @torch.inference_mode(False)
    def __init__(self, device: torch.device, width: int, sink_block: int, rows: int = 8) -> None:
        self.device = device
        self.width = -(-max(width, 1) // ALIGN) * ALIGN
        self.table = torch.full((max(rows, 2), self.width), sink_block, dtype=torch.int32, device=device)
        self.mirror: list[list[int]] = [[sink_block] * self.width] + [[] for _ in range(self.table.shape[0] - 1)]
        self.last: list[int] = []  # each plan position's row in the latest step
        self.used = [0] * self.table.shape[0]  # the step that last used each row (least recent is reused first)
        self.clock = 0

    def place(self, tables: list[list[int]]) -> TableDelta:
        """Each table's row and the entries that changed (host work only; `apply` writes them)."""
        self.clock += 1
        if max(map(len, tables), default=0) > self.width:
            self._widen(max(map(len, tables)))
        delta, taken = TableDelta(), {SINK_ROW}
        for position, table in enumerate(tables):
            row, kept = self._row_for(position, table, taken)
            taken.add(row)
            delta.rows.append(row)
            delta.index.extend(range(row * self.width + kept, row * self.width + len(table)))
            delta.values.extend(table[kept:])
            if kept < len(table):
                del self.mirror[row][kept:]
                self.mirror[row].extend(table[kept:])
            self.used[row] = self.clock
        self.last = delta.rows
        return delta

    def apply(self, delta: TableDelta, index: torch.Tensor, values: torch.Tensor) -> None:
        """Write the step's changed entries (their device copies: index int64, values int32)."""
        if delta.index:
            self.table.view(-1).index_copy_(0, index, values)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's tables [S, width] (into `out`, a CUDA graph's static buffer, when given; always into a
        given buffer: torch's CPU index_select is a thousand times slower without one)."""
        if out is None:
            out = torch.empty(rows.shape[0], self.width, dtype=torch.int32, device=self.device)
        return torch.index_select(self.table, 0, rows, out=out)

    def _row_for(self, position: int, table: list[int], taken: set[int]) -> tuple[int, int]:
        """The row holding this table's start and how many entries it holds already: the position's row last
        step, else the longest agreeing row, else the least recently used free row (the table grows by a row
        when none is free)."""
        hint = self.last[position] if position < len(self.last) else None
        if hint is not None and hint not in taken and table:
            kept = _agreeing(self.mirror[hint], table)
            if kept:
                return hint, kept
        free = [row for row in range(len(self.mirror)) if row not in taken]
        if table:
            agreeing = [(_agreeing(self.mirror[row], table), row) for row in free if self.mirror[row][:1] == table[:1]]
            if agreeing:
                kept, row = max(agreeing)
                return row, kept
        row = self._grow() if not free else min(free, key=lambda row: self.used[row])
        return row, _agreeing(self.mirror[row], table)

    @torch.inference_mode(False)
    def _grow(self) -> int:
        """Double the rows; returns the first new one."""
        first = self.table.shape[0]
        extra = torch.zeros(first, self.width, dtype=torch.int32, device=self.device)
        self.table = torch.cat([self.table, extra])
        self.mirror += [[] for _ in range(first)]
        self.used += [0] * first
        return first

    @torch.inference_mode(False)
    def _widen(self, entries: int) -> None:
        """Room for a longer table (the rows' entries are kept)."""
        width = -(-entries // ALIGN) * ALIGN
        wider = torch.zeros(self.table.shape[0], width, dtype=torch.int32, device=self.device)
        wider[:, : self.width] = self.table
        self.table, self.width = wider, width
