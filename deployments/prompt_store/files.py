"""The store's files: owner-only, never through a symlink, written so a crash never leaves a piece that
passes its check half-written (temp file, fsync, rename, fsync of the folder).

A piece file holds a run of consecutive blocks of one prompt-state chain: a length-prefixed JSON header
(block names, their token ids, the payload's SHA-256) then the payload, `block_bytes` per block. A state
file (hybrid models) has the same layout: one name (the block its snapshot ends at), no tokens, and one
snapshot's bytes.
"""

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600
PIECE_SUFFIX = ".piece"
STATE_SUFFIX = ".state"
TEMP_SUFFIX = ".tmp"
_HEADER_LEN = struct.Struct("<I")


class DamagedPiece(Exception):
    """A piece whose bytes do not match its stored hash (or that cannot be parsed)."""


def secure_dir(path: Path) -> Path:
    """Create `path` (and parents under it) 0700 whatever the umask; refuse a symlink in its place."""
    if path.is_symlink():
        raise PermissionError(f"{path} is a symlink: the store does not follow links")
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE, follow_symlinks=False)
    return path


def write_file_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` 0600 via a temp file in the same folder: a reader sees all of it or none."""
    temp = path.with_name(f".{path.name}.{os.getpid()}{TEMP_SUFFIX}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)  # O_CREAT's mode is masked by the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:  # a full disk, an I/O error: no partial file stays behind
        with contextlib.suppress(OSError):  # the original error is the one to report
            temp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_temp_files(folder: Path) -> int:
    """Temp files a crash left mid-write (never renamed, so never a piece): removed when a folder is opened."""
    removed = 0
    for path in folder.glob(f".*{TEMP_SUFFIX}"):
        if path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def read_file(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass
class PieceHeader:
    parent: bytes | None  # the name of the block before the first one (None: the chain's start)
    hashes: list[bytes]  # the blocks' chained names, in chain order
    token_ids: list[list[int]]  # each block's tokens (a hit is confirmed by them, as in RAM)
    block_bytes: int
    sha256: str  # of the payload

    def to_json(self) -> bytes:
        body = {
            "version": 1,
            "parent": self.parent.hex() if self.parent else None,
            "hashes": [h.hex() for h in self.hashes],
            "token_ids": self.token_ids,
            "block_bytes": self.block_bytes,
            "sha256": self.sha256,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "PieceHeader":
        body = json.loads(raw)
        parent = bytes.fromhex(body["parent"]) if body.get("parent") else None
        return cls(
            parent, [bytes.fromhex(h) for h in body["hashes"]], body["token_ids"], body["block_bytes"], body["sha256"]
        )


def encode_piece(
    parent: bytes | None, hashes: list[bytes], token_ids: list[list[int]], payload: bytes, block_bytes: int
) -> bytes:
    header = PieceHeader(parent, hashes, token_ids, block_bytes, hashlib.sha256(payload).hexdigest()).to_json()
    return _HEADER_LEN.pack(len(header)) + header + payload


def read_header(path: Path) -> PieceHeader:
    """Only the header (index rebuilds read no payload)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        (length,) = _HEADER_LEN.unpack(os.read(fd, _HEADER_LEN.size))
        return PieceHeader.from_json(os.read(fd, length))
    except (struct.error, ValueError, KeyError) as exc:
        raise DamagedPiece(f"{path.name}: unreadable header ({exc})") from exc
    finally:
        os.close(fd)


def decode_piece(path: Path) -> tuple[PieceHeader, bytes]:
    """Header and payload, the payload checked against its hash (DamagedPiece if it does not match)."""
    raw = read_file(path)
    try:
        (length,) = _HEADER_LEN.unpack_from(raw)
        header = PieceHeader.from_json(raw[_HEADER_LEN.size : _HEADER_LEN.size + length])
    except (struct.error, ValueError, KeyError) as exc:
        raise DamagedPiece(f"{path.name}: unreadable header ({exc})") from exc
    payload = raw[_HEADER_LEN.size + length :]
    if len(payload) != header.block_bytes * len(header.hashes) or hashlib.sha256(payload).hexdigest() != header.sha256:
        raise DamagedPiece(f"{path.name}: its bytes do not match its hash")
    return header, payload
