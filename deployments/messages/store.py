"""What an engine and its node's PromptStore actor exchange: caps, pieces to write, block rows, hybrid
models' state snapshots, figures, and the typed calls that carry them (`StoreCall`: in-process, over Ray,
or relayed by a Scheduler replica for its engine's process)."""

from dataclasses import dataclass, field

import numpy as np

from deployments.messages.calls import Call, Reply


@dataclass(frozen=True)
class StoreCaps:
    max_bytes: int  # every set together (--learn-gib)
    min_free_bytes: int  # free disk kept (--learn-min-free-gib)
    daily_bytes: int  # written per day (--learn-daily-gib)


@dataclass
class StateRows:
    """Hybrid models' state snapshots: each is every recurrent layer's conv history and recurrent state
    after the tokens its name covers (the chained name of the block it ends at, as in RAM)."""

    names: list[bytes]
    state_bytes: int  # one snapshot: every layer's tensors (and every rank's shard) in order
    payload: np.ndarray  # uint8, state_bytes per snapshot, in `names` order


@dataclass
class PieceWrite:
    """A run of blocks a Scheduler asks to store (the payload travels through Ray's object store), and the
    state snapshots ending at blocks of it or at blocks the set holds (hybrid models)."""

    set_id: str
    parent: bytes | None  # the name of the block before the first one (None: the chain's start)
    hashes: list[bytes]  # empty when only states are new
    token_ids: list[list[int]]
    block_bytes: int
    payload: np.ndarray  # uint8, block_bytes per block, in `hashes` order
    states: StateRows | None = None  # None: no snapshot to store


@dataclass
class BlockRows:
    """Blocks read back, checked: the longest run of the asked names the set holds."""

    hashes: list[bytes]
    token_ids: list[list[int]]
    payload: np.ndarray  # uint8, block_bytes per block
    read_seconds: float
    state: StateRows | None = None  # the snapshot asked for, when every asked block was found and it checked


@dataclass
class SetIndex:
    """What a set holds when it is opened, by name."""

    blocks: list[bytes]
    states: list[bytes]  # hybrid models: the blocks a stored state snapshot ends at


@dataclass
class StoreStats:
    bytes_held: int = 0  # this set's pieces and state snapshots
    pieces_written: int = 0
    pieces_read: int = 0
    blocks_read: int = 0
    damaged_pieces: int = 0  # damaged state snapshots included
    writes_skipped: int = 0  # by a cap (total size, free disk, daily)
    states_written: int = 0  # hybrid models' state snapshots, each beside the block it ends at
    states_read: int = 0
    # Writes that failed, by reason (prompt_store/failures.py): the disk's (no_space, permission, io_error),
    # counted by the store since its actor started, and `unavailable`: writes its actor died before running,
    # counted by the replica that sent them. No partial file stays behind any of them.
    write_failures: dict[str, int] = field(default_factory=dict)
    available: bool = True  # False: the store's actor did not answer the latest question (/health asks it)
    unavailable_reason: str = ""  # why, while not available (no actor id or process id: the log has more)


@dataclass
class StoreUnavailable:
    """DELETE /v1/imprint's answer from an engine whose store did not delete (the route answers 503)."""

    message: str  # for the client: what happened and what to do (no actor id or process id)


class StoreCall(Call[Reply]):
    """A call on the node's PromptStore (prompt_store/actor.py answers each; links.py carries them)."""


@dataclass(frozen=True)
class OpenSet(StoreCall[SetIndex]):
    """Open (or create) a set: what it holds, by name."""

    set_id: str


@dataclass(frozen=True)
class WritePiece(StoreCall[list[bytes]]):
    """Store a piece (the names it stored; an engine sends it without waiting)."""

    piece: PieceWrite


@dataclass(frozen=True)
class ReadRows(StoreCall[BlockRows | None]):
    """The longest leading run of `hashes` the set holds, read back (and the snapshot ending at `state_at`)."""

    set_id: str
    hashes: list[bytes]
    state_at: bytes | None = None


@dataclass(frozen=True)
class LookUp(StoreCall[SetIndex]):
    """The leading run of `hashes` the set holds, looking past its index (a folder other nodes write to)."""

    set_id: str
    hashes: list[bytes]
    with_states: bool = False


@dataclass(frozen=True)
class DeleteSet(StoreCall[int]):
    """Delete a set's pieces: the bytes freed."""

    set_id: str


@dataclass(frozen=True)
class ReadStats(StoreCall[StoreStats]):
    """The set's figures."""

    set_id: str
