"""A set's index in the store's memory: its pieces, the block each name is in, its state snapshots."""

from dataclasses import dataclass, field
from pathlib import Path

from deployments.messages.store import StoreStats


@dataclass
class Piece:
    path: Path
    parent: bytes | None  # the block before the piece's first (None: the chain's start)
    hashes: list[bytes]  # its blocks' names, in chain order
    size: int  # the file's bytes
    used: float  # last read or written (time.time()): the eviction order


@dataclass
class StateFile:
    path: Path
    size: int


@dataclass
class SetEntry:
    folder: Path
    pieces: dict[str, Piece] = field(default_factory=dict)  # file name -> piece
    blocks: dict[bytes, tuple[str, int]] = field(default_factory=dict)  # name -> (piece, index in it)
    states: dict[bytes, StateFile] = field(default_factory=dict)  # a snapshot's block name -> its file
    stats: StoreStats = field(default_factory=StoreStats)

    def add(self, piece: Piece) -> None:
        self.pieces[piece.path.name] = piece
        for index, name in enumerate(piece.hashes):
            self.blocks[name] = (piece.path.name, index)
        self.stats.bytes_held += piece.size

    def forget(self, name: str) -> Piece:
        """Drop a piece from the index (its file is the caller's to delete, or to keep)."""
        piece = self.pieces.pop(name)
        for block in piece.hashes:
            if self.blocks.get(block, (None,))[0] == name:
                del self.blocks[block]
        self.stats.bytes_held -= piece.size
        return piece
