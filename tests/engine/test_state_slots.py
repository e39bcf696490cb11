"""Hybrid models' state slots as pure bookkeeping: lanes, rolling snapshots named by block hash, LRU, caps."""

from deployments.messages.prefix import PromptHashes
from deployments.messages.step import ZERO_STATE
from deployments.scheduler.engine.state_slots import StateSlots

BLOCK = 16


def _tokens(count: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(count)]


def _name(tokens: list[int]) -> bytes:
    return PromptHashes.of(tokens, BLOCK).hashes[-1]


def test_a_fresh_sequence_gets_a_running_and_a_rolling_slot_starting_from_zero() -> None:
    slots = StateSlots(num_slots=6, block_size=BLOCK, max_snapshots=2, snapshot_tokens=64)
    states = slots.start(None)
    assert states.restore_from == ZERO_STATE
    assert states.running != states.rolling and {states.running, states.rolling} <= set(range(6))
    assert slots.num_used == 2
    slots.release(states)
    assert slots.num_used == 0 and len(slots.free) == 6


def test_the_rolling_slot_is_named_by_its_tokens_block_hash_and_found_again() -> None:
    slots = StateSlots(num_slots=6, block_size=BLOCK, max_snapshots=2, snapshot_tokens=64)
    states = slots.start(None)
    rolling = states.rolling
    states.rolling_tokens = 32
    tokens = _tokens(40)
    slots.name_if_due(states, tokens, now=True)
    assert slots.snapshot(_name(tokens[:32])) == rolling  # the snapshot covers the first two blocks
    assert states.rolling not in (None, rolling) and states.named_tokens == 32
    slots.release(states)
    assert slots.snapshot(_name(tokens[:32])) == rolling  # a named snapshot outlives its sequence
    resumed = slots.start(rolling)
    assert resumed.restore_from == rolling and rolling in slots.pinned


def test_snapshots_are_due_at_ends_and_every_snapshot_tokens() -> None:
    slots = StateSlots(num_slots=8, block_size=BLOCK, max_snapshots=4, snapshot_tokens=64)
    states = slots.start(None)
    tokens = _tokens(200)
    states.rolling_tokens = 48
    slots.name_if_due(states, tokens, now=False)  # 48 < 64 since the last name: not yet
    assert not slots.snapshots
    states.rolling_tokens = 64
    slots.name_if_due(states, tokens, now=False)
    assert list(slots.snapshots) == [_name(tokens[:64])]
    states.rolling_tokens = 80
    slots.name_if_due(states, tokens, now=True)  # a prompt or reply ended: whatever passed since
    assert list(slots.snapshots) == [_name(tokens[:64]), _name(tokens[:80])]
    slots.name_if_due(states, tokens, now=True)  # nothing new since: nothing named
    assert len(slots.snapshots) == 2


def test_snapshots_beyond_the_cap_go_least_recently_used_first() -> None:
    slots = StateSlots(num_slots=8, block_size=BLOCK, max_snapshots=2, snapshot_tokens=16)
    names = []
    for turn in range(3):
        states = slots.start(None)
        tokens = _tokens(32, offset=100 * turn)
        states.rolling_tokens = 32
        slots.name_if_due(states, tokens, now=True)
        names.append(_name(tokens))
        slots.release(states)
        if turn == 1:
            slots.snapshot(names[0])  # a hit: the first becomes the most recently used
    assert set(slots.snapshots) == {names[0], names[2]}
    assert slots.num_used == 0 and len(slots.free) + len(slots.snapshots) == 8


def test_a_pinned_snapshot_is_not_taken_until_its_step_ran() -> None:
    slots = StateSlots(num_slots=3, block_size=BLOCK, max_snapshots=1, snapshot_tokens=16)
    first = slots.start(None)
    first.rolling_tokens = 16
    tokens = _tokens(16)
    slots.name_if_due(first, tokens, now=True)  # its rolling slot became the snapshot; it took the last free one
    source = slots.snapshot(_name(tokens))
    slots.release(first)
    resumed = slots.start(source)  # pins the source: the two slots it takes are the free ones
    assert source not in (resumed.running, resumed.rolling)
    assert slots.take() is None  # the only other slot is the pinned snapshot
    slots.step_ran()
    assert slots.take() == source
