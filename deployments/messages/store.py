"""What an engine and its node's PromptStore actor exchange: caps, pieces to write, block rows, figures."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StoreCaps:
    max_bytes: int  # every set together (--learn-gib)
    min_free_bytes: int  # free disk kept (--learn-min-free-gib)
    daily_bytes: int  # written per day (--learn-daily-gib)


@dataclass
class PieceWrite:
    """A run of blocks a Scheduler asks to store (the payload travels through Ray's object store)."""

    set_id: str
    parent: bytes | None  # the name of the block before the first one (None: the chain's start)
    hashes: list[bytes]
    token_ids: list[list[int]]
    block_bytes: int
    payload: np.ndarray  # uint8, block_bytes per block, in `hashes` order


@dataclass
class BlockRows:
    """Blocks read back, checked: the longest run of the asked names the set holds."""

    hashes: list[bytes]
    token_ids: list[list[int]]
    payload: np.ndarray  # uint8, block_bytes per block
    read_seconds: float


@dataclass
class StoreStats:
    bytes_held: int = 0  # this set's pieces
    pieces_written: int = 0
    pieces_read: int = 0
    blocks_read: int = 0
    damaged_pieces: int = 0
    writes_skipped: int = 0  # by a cap (total size, free disk, daily)
