"""The paged KV block manager with a chained-hash prefix cache.

Blocks hold `block_size` tokens. A full block is named by the hash of its parent's hash and its own token
ids, so one name means one whole prefix; a hit is confirmed by comparing the tokens. Unreferenced named
blocks stay cached, least recently used first out, up to the prompt-cache cap.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from deployments.messages.images import ImageInput
from deployments.messages.prefix import KEY_BYTES, PrefixDigest, PromptHashes, chain_hash, image_marks


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache
    token_ids: tuple[int, ...] = ()  # the tokens behind `block_hash`, to confirm a hit


@dataclass
class BlockTable:
    """One sequence's blocks (owned by its Sequence, changed only by the BlockManager)."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks already named in the cache
    last_hash: bytes | None = None  # hash of block `num_hashed - 1`


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, max_cached_blocks: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.block_size = block_size
        self.num_blocks = num_blocks
        # None = cached blocks may fill the whole pool; 0 = no reuse across requests.
        self.max_cached_blocks = num_blocks if max_cached_blocks is None else max_cached_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self.evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced named blocks, LRU first
        self.by_hash: dict[bytes, int] = {}
        self.version = 0  # counts changes to the named blocks, so a digest is only rebuilt after one

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence references (what the KV usage gauge reports)."""
        return self.num_blocks - self.num_available

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def match_prefix(
        self,
        token_ids: list[int],
        max_tokens: int,
        known: PromptHashes | None = None,
        images: Sequence[ImageInput] = (),
    ) -> list[int]:
        """Cached full blocks that start `token_ids`, covering at most `max_tokens` tokens.

        `known` holds names the router already computed for these tokens (and `images`); a hit is confirmed
        by its tokens.
        """
        reuse = known.hashes if known is not None and known.block_size == self.block_size else []
        hits: list[int] = []
        parent: bytes | None = None
        for index, start in enumerate(range(0, max_tokens - self.block_size + 1, self.block_size)):
            chunk = token_ids[start : start + self.block_size]
            parent = reuse[index] if index < len(reuse) else self._name(parent, chunk, start, images)
            block_id = self.by_hash.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tuple(chunk):
                break
            hits.append(block_id)
        return hits

    def adopt_prefix(
        self,
        table: BlockTable,
        token_ids: list[int],
        max_tokens: int,
        known: PromptHashes | None = None,
        images: Sequence[ImageInput] = (),
    ) -> int:
        """Give an empty table the cached blocks that start `token_ids`; returns the tokens covered."""
        assert not table.block_ids, "prefix adoption happens before a sequence holds blocks"
        if self.max_cached_blocks == 0:
            return 0
        hits = self.match_prefix(token_ids, max_tokens, known, images)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.evictable.pop(block_id, None)
            block.ref_count += 1
        table.block_ids = hits
        table.num_hashed = len(hits)
        table.last_hash = self.blocks[hits[-1]].block_hash if hits else None
        return len(hits) * self.block_size

    # ---- allocation -----------------------------------------------------------------------------------
    def can_grow(self, table: BlockTable, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table.block_ids) <= self.num_available

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Make `table` cover `num_tokens` tokens; the caller checked `can_grow`."""
        need = self.blocks_for(num_tokens) - len(table.block_ids)
        if need > self.num_available:
            raise MemoryError("KV pool exhausted")
        for _ in range(need):
            table.block_ids.append(self._take_block())

    def _take_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.pop()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently used cached block
            self._forget(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None and self.by_hash.get(block.block_hash) == block.block_id:
            del self.by_hash[block.block_hash]
            self.version += 1
        block.block_hash = None
        block.token_ids = ()

    def _name(self, parent: bytes | None, chunk: list[int], start: int, images: Sequence[ImageInput]) -> bytes:
        """The block name messages/prefix.py gives the block of `chunk` starting at token `start`."""
        marks = image_marks(images, start, start + self.block_size) if images else b""
        return chain_hash(parent, chunk, marks)

    def register_full_blocks(
        self, table: BlockTable, token_ids: list[int], num_computed: int, images: Sequence[ImageInput] = ()
    ) -> None:
        """Name the blocks whose tokens are all computed, so later prompts can reuse them."""
        if self.max_cached_blocks == 0:
            return
        full = min(num_computed // self.block_size, len(table.block_ids))
        for index in range(table.num_hashed, full):
            chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
            block_hash = self._name(table.last_hash, chunk, index * self.block_size, images)
            block = self.blocks[table.block_ids[index]]
            if block.block_hash is None and block_hash not in self.by_hash:
                block.block_hash = block_hash
                block.token_ids = tuple(chunk)
                self.by_hash[block_hash] = block.block_id
                self.version += 1
            table.last_hash = block_hash
            table.num_hashed = index + 1

    def release(self, table: BlockTable) -> None:
        """Drop a sequence's references; named blocks stay cached (newest last), others go free."""
        for block_id in reversed(table.block_ids):  # tail blocks are the least reusable: evict them first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self.evictable[block_id] = None
                self.evictable.move_to_end(block_id)
            else:
                self.free_ids.append(block_id)
        table.block_ids = []
        table.num_hashed = 0
        table.last_hash = None
        self._trim_cache()

    def _trim_cache(self) -> None:
        while len(self.evictable) > self.max_cached_blocks:
            block_id, _ = self.evictable.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.free_ids.append(block_id)

    def digest(self) -> PrefixDigest:
        """The keys of every named block held (in use or cached), for the prefix-affinity router."""
        keys = b"".join(block_hash[:KEY_BYTES] for block_hash in self.by_hash)
        return PrefixDigest(self.block_size, keys, self.version)

    def take_for_restore(self, count: int) -> list[int]:
        """Blocks to copy restored rows into (referenced until `name_restored` hands them to the cache)."""
        return [self._take_block() for _ in range(count)]

    def name_restored(self, block_id: int, block_hash: bytes, token_ids: list[int]) -> None:
        """A block whose rows were read back from disk joins the cache as its most recently used entry."""
        block = self.blocks[block_id]
        block.ref_count = 0
        if block_hash in self.by_hash or self.max_cached_blocks == 0:
            self.free_ids.append(block_id)
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self.by_hash[block_hash] = block_id
        self.version += 1
        self.evictable[block_id] = None
        self.evictable.move_to_end(block_id)
        self._trim_cache()

    def resident_chain(self, table: BlockTable) -> list[tuple[bytes, int, tuple[int, ...]]]:
        """A sequence's named blocks: (name, block id, tokens), in chain order (what the disk store keeps)."""
        named = []
        for block_id in table.block_ids[: table.num_hashed]:
            block = self.blocks[block_id]
            if block.block_hash is None:  # a duplicate of a block named elsewhere: the chain stops here
                break
            named.append((block.block_hash, block_id, block.token_ids))
        return named

    def still_holds(self, block_hash: bytes, block_id: int) -> bool:
        return self.by_hash.get(block_hash) == block_id
