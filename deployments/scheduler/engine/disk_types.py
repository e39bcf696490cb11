"""What the engine's side of the disk store speaks (disk_states.py) besides the link to the node's
PromptStore (prompt_store/links.py): the KV rows' reads and writes, and a prompt's resume plan."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from deployments.scheduler.engine.disk_snapshots import StateSlotsIO


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
