"""Block manager: ref counts, free list, chained hashes with a token check, LRU eviction, the cache cap."""

from deployments.messages.prefix import chain_hash
from deployments.scheduler.engine.kv_blocks import BlockManager, BlockTable


def _filled(manager: BlockManager, tokens: list[int]) -> BlockTable:
    table = BlockTable()
    manager.grow(table, len(tokens))
    manager.register_full_blocks(table, tokens, len(tokens))
    return table


def test_chain_hash_names_the_whole_prefix() -> None:
    a = chain_hash(None, [1, 2, 3, 4])
    assert a == chain_hash(None, [1, 2, 3, 4])
    assert chain_hash(a, [5, 6]) != chain_hash(chain_hash(None, [9, 9, 9, 9]), [5, 6])


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    first = _filled(manager, prompt)
    assert len(first.block_ids) == 3 and manager.num_available == 5
    second = BlockTable()
    covered = manager.adopt_prefix(second, prompt + [99], max_tokens=10)
    assert covered == 8  # two full blocks; the partial third is never shared
    assert second.block_ids == first.block_ids[:2]
    assert manager.blocks[first.block_ids[0]].ref_count == 2


def test_released_blocks_stay_cached_until_evicted_lru() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    old = _filled(manager, [1, 2, 3, 4])
    manager.release(old)
    assert manager.num_available == 4  # cached but evictable
    newer = _filled(manager, [7, 8, 9, 10])
    manager.release(newer)
    # Taking three blocks evicts the least recently released ones first: the old prompt's.
    taker = BlockTable()
    manager.grow(taker, 6)
    probe = BlockTable()
    assert manager.adopt_prefix(probe, [7, 8, 9, 10, 11], max_tokens=4) == 2  # one of newer's blocks survived
    assert manager.match_prefix([1, 2, 3, 4], 4) == []


def test_hash_hit_is_confirmed_by_tokens() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    table = _filled(manager, [1, 2])
    block = manager.blocks[table.block_ids[0]]
    block.token_ids = (5, 5)  # a forged collision must not be served
    assert manager.match_prefix([1, 2, 3], 2) == []


def test_zero_cache_cap_turns_reuse_off() -> None:
    manager = BlockManager(num_blocks=4, block_size=2, max_cached_blocks=0)
    table = _filled(manager, [1, 2, 3, 4])
    manager.release(table)
    assert manager.num_available == 4
    assert manager.adopt_prefix(BlockTable(), [1, 2, 3, 4, 5], 4) == 0


def test_cache_cap_bounds_unreferenced_blocks() -> None:
    manager = BlockManager(num_blocks=8, block_size=2, max_cached_blocks=1)
    manager.release(_filled(manager, [1, 2, 3, 4, 5, 6]))
    assert len(manager.evictable) == 1 and len(manager.free_ids) == 7


def test_pool_exhaustion_is_reported_not_crashed() -> None:
    manager = BlockManager(num_blocks=2, block_size=2)
    table = BlockTable()
    assert manager.can_grow(table, 4) and not manager.can_grow(table, 5)
