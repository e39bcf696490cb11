"""What the engine's side of the disk store speaks (disk_states.py): the link to the node's PromptStore,
the KV rows' reads and writes, and a prompt's resume plan."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deployments.messages.store import BlockRows, PieceWrite, SetIndex, StoreStats
from deployments.scheduler.engine.disk_snapshots import StateSlotsIO


class StoreLink(Protocol):
    """Calls into the PromptStore (in-process, over Ray, or relayed by the engine's parent process)."""

    def open_set(self, set_id: str) -> SetIndex: ...

    def write(self, piece: PieceWrite) -> None: ...  # never waits for the disk

    def flush(self, timeout_s: float) -> None: ...  # waits (up to timeout_s) for the writes sent so far

    def read(self, set_id: str, hashes: list[bytes], state_at: bytes | None = None) -> BlockRows | None: ...

    # The leading run of `hashes` the store holds, looking past its index (a folder other nodes write to)
    def lookup(self, set_id: str, hashes: list[bytes], with_states: bool = False) -> SetIndex: ...

    def delete_set(self, set_id: str) -> int: ...

    def stats(self, set_id: str) -> StoreStats: ...


class BlockRowsIO(StateSlotsIO, Protocol):
    def read_block_rows(self, block_ids: list[int]) -> np.ndarray: ...

    def write_block_rows(self, block_ids: list[int], rows: np.ndarray) -> None: ...

    def kv_bytes_per_token(self) -> int: ...  # every rank's shard


@dataclass
class Resumable:
    """How much of a prompt resumes, and from where (the imprint routes' answer, before any read)."""

    tokens: int
    ram_tokens: int
    disk_tokens: int
    disk_bytes: int
    read_seconds: float  # estimated
    prefill_seconds: float  # estimated, for the disk tokens
    read_from: int = 0  # the first block to read (RAM holds those before it)
    state_at: bytes | None = None  # hybrid models: the snapshot to read with the blocks (None: RAM holds it)

    @property
    def worth_reading(self) -> bool:
        return self.disk_tokens > self.ram_tokens and self.read_seconds < self.prefill_seconds
