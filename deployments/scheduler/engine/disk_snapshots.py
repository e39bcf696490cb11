"""Hybrid models' state snapshots in the disk prompt-state store (docs/store.md, docs/engine.md Hybrid models).

A recurrent layer resumes only from its state after a prefix, so KV rows on disk are useless to a hybrid
model without the snapshot at the same block. The engine's snapshots in RAM (state_slots.py) are named by
the chained hash of the block they end at; each is written beside that block, once, and a prompt resumes
from disk only at a block where the store holds a snapshot. A snapshot read back joins RAM's cache under
its name, so admission resumes from it as from any cached snapshot.
"""

from typing import Protocol

import numpy as np

from deployments.messages.store import BlockRows, StateRows
from deployments.scheduler.engine.state_slots import StateSlots


class StateSlotsIO(Protocol):
    def read_state_slots(self, slots: list[int]) -> np.ndarray: ...  # [n, state bytes]

    def write_state_slots(self, slots: list[int], rows: np.ndarray) -> None: ...


class DiskSnapshots:
    """Which snapshots the store holds, which RAM holds that it does not yet, and the copies between them."""

    def __init__(self, slots: StateSlots, io: StateSlotsIO, state_bytes: int) -> None:
        self.slots, self.io, self.state_bytes = slots, io, state_bytes
        self.on_disk: set[bytes] = set()  # the set's snapshots (filled when the set is opened)

    def in_ram(self, name: bytes) -> bool:
        return name in self.slots.snapshots

    def waiting(self, name: bytes) -> bool:
        """RAM holds this block's snapshot and the store does not yet."""
        return self.in_ram(name) and name not in self.on_disk

    def resume_points(self, names: list[bytes], ram: int, disk: int) -> tuple[int, int, bytes | None]:
        """For a prompt's block names, of which RAM holds the first `ram` and the store the first `disk`: the
        blocks it resumes from in RAM (the longest run ending at a cached snapshot, as the planner finds
        it) and on disk (the longest ending at a stored snapshot), and the snapshot a restore reads (None:
        RAM holds it, or no restore is due)."""
        from_ram = next((n for n in range(ram, 0, -1) if self.in_ram(names[n - 1])), 0)
        stored = self.slots.max_snapshots > 0  # else RAM could not cache a snapshot read back
        end = next((n for n in range(disk, 0, -1) if stored and names[n - 1] in self.on_disk), 0)
        state_at = None if end <= from_ram or self.in_ram(names[end - 1]) else names[end - 1]
        return from_ram, end, state_at

    def rows_of(self, names: list[bytes]) -> StateRows:
        """RAM's snapshots under these names, as bytes for the store (read between steps, so no step is
        writing them)."""
        slots = [self.slots.snapshots[name] for name in names]
        return StateRows(list(names), self.state_bytes, self.io.read_state_slots(slots).reshape(-1))

    def restore(self, state_at: bytes | None, rows: BlockRows | None) -> bool:
        """After the blocks were read: whether a snapshot now waits in RAM's cache at their end (the one
        read with them, `state_at`, or RAM's own when `state_at` is None)."""
        if state_at is None:
            return True
        if rows is None or rows.state is None:  # damaged (the store deleted it), or gone under a cap
            self.on_disk.discard(state_at)
            return False
        return self.install(rows.state)

    def install(self, state: StateRows) -> bool:
        """A snapshot read back joins RAM's cache (False: no slot could take it)."""
        (name,) = state.names
        if state.state_bytes != self.state_bytes:
            return False
        slot = self.slots.take()
        if slot is None:
            return False
        self.io.write_state_slots([slot], state.payload.reshape(1, self.state_bytes))
        self.slots.keep(name, slot)
        return True
