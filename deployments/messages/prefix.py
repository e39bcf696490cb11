"""Chained block hashes of token ids: the prefix cache's block names, the router's match keys.

A full block of `block_size` tokens is named by the hash of its parent's name and its own ids, so one name
stands for a whole prefix. The Scheduler's block manager names its blocks this way, the prefix-affinity
router hashes each request's prompt the same way (once, in Ingress) and the engine reuses those names, and
prompt states on disk are named by them too: so never Python's salted `hash()`.

A block covering any placeholder token of an image also folds in that image's pixels' SHA-256 (every image
it touches, in prompt order), so a repeated image names the same blocks and another image behind the same
placeholder ids never does.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from deployments.messages.images import ImageInput

HASH_BYTES = 16
KEY_BYTES = 8  # a digest carries each name's first 8 bytes: a false match needs a 64-bit collision


def chain_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...], images: bytes = b"") -> bytes:
    """The name of a full block whose parent is named `parent` (None for the first block); `images`: the
    SHA-256s of the images whose placeholders it covers (`image_marks`), empty for text."""
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    digest.update(parent or b"\x00" * HASH_BYTES)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    if images:
        digest.update(images)
    return digest.digest()


def image_marks(images: Sequence[ImageInput], start: int, end: int) -> bytes:
    """The SHA-256s, in order, of the images with a placeholder among tokens [start, end)."""
    return b"".join(image.sha256 for image in images if image.offset < end and image.end > start)


@dataclass
class PromptHashes:
    """The names of a prompt's full blocks, in order (set by the router, reused by the engine)."""

    block_size: int
    hashes: list[bytes]

    @classmethod
    def of(cls, token_ids: list[int], block_size: int, images: Sequence[ImageInput] = ()) -> "PromptHashes":
        hashes: list[bytes] = []
        parent: bytes | None = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            marks = image_marks(images, start, start + block_size) if images else b""
            parent = chain_hash(parent, token_ids[start : start + block_size], marks)
            hashes.append(parent)
        return cls(block_size, hashes)

    def keys(self) -> list[bytes]:
        return [h[:KEY_BYTES] for h in self.hashes]


@dataclass
class PrefixDigest:
    """What one Scheduler replica holds: the keys of its resident named blocks (sent with routing stats)."""

    block_size: int
    keys: bytes  # KEY_BYTES per resident block, in no particular order
    version: int = 0  # counts the digests an engine took: a new one means something changed
    disk_keys: bytes = b""  # the same for the blocks its node's disk store holds (learn on)

    @property
    def num_blocks(self) -> int:
        return len(self.keys) // KEY_BYTES

    def key_set(self) -> set[bytes]:
        return split_keys(self.keys)

    def disk_key_set(self) -> set[bytes]:
        return split_keys(self.disk_keys)


def split_keys(keys: bytes) -> set[bytes]:
    return {keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)}
