"""The prefix-affinity rule and the block names it matches on, without Ray."""

from deployments.messages.prefix import KEY_BYTES, PromptHashes
from deployments.routing.affinity import AFFINITY, BALANCE, NO_MATCH, ReplicaView, RoutingKnobs, choose_replica
from deployments.scheduler.engine.kv_blocks import BlockManager, BlockTable

KNOBS = RoutingKnobs(balance_abs=2, balance_rel=1.5, min_match=0.25)
PROMPT = list(range(100, 164))  # four blocks of 16


def _keys(token_ids: list[int]) -> list[bytes]:
    return PromptHashes.of(token_ids, 16).keys()


def _view(name: str, load: int = 0, holds: list[int] | None = None, routed: int = 0) -> ReplicaView:
    return ReplicaView(name, load, set(_keys(holds or [])), routed)


def test_the_router_names_blocks_as_the_block_manager_does() -> None:
    blocks = BlockManager(num_blocks=8, block_size=16)
    table = BlockTable()
    blocks.grow(table, len(PROMPT))
    blocks.register_full_blocks(table, PROMPT, len(PROMPT))
    digest = blocks.digest()
    assert digest.num_blocks == 4 and len(digest.keys) == 4 * KEY_BYTES
    assert digest.key_set() == set(_keys(PROMPT))
    # The engine's match reuses the router's names and finds the same blocks it would find alone.
    known = PromptHashes.of(PROMPT + [1, 2, 3], 16)
    assert blocks.match_prefix(PROMPT + [1, 2, 3], 67, known) == blocks.match_prefix(PROMPT + [1, 2, 3], 67)
    assert len(blocks.match_prefix(PROMPT, 64, known)) == 4
    # Names made at another block size are not trusted: the match recomputes its own.
    assert len(blocks.match_prefix(PROMPT, 64, PromptHashes.of(PROMPT, 8))) == 4


def test_a_digest_changes_version_only_when_named_blocks_change() -> None:
    blocks = BlockManager(num_blocks=4, block_size=16, max_cached_blocks=1)
    table = BlockTable()
    start = blocks.version
    blocks.grow(table, 32)
    assert blocks.version == start  # allocation names nothing
    blocks.register_full_blocks(table, PROMPT[:32], 32)
    assert blocks.version == start + 2
    blocks.release(table)  # the cache keeps one block: the other name goes
    assert blocks.version == start + 3 and blocks.digest().num_blocks == 1


def test_a_prompt_goes_to_the_replica_holding_its_longest_prefix() -> None:
    views = [_view("a", holds=PROMPT[:16]), _view("b", holds=PROMPT[:48]), _view("c")]
    decision = choose_replica(views, _keys(PROMPT), KNOBS)
    assert (decision.replica_id, decision.reason, decision.matched_blocks) == ("b", AFFINITY, 3)


def test_a_match_stops_at_the_first_missing_block() -> None:
    holder = ReplicaView("a", 0, set(_keys(PROMPT)[1:]))  # every block but the first
    decision = choose_replica([holder, _view("b")], _keys(PROMPT), KNOBS)
    assert decision.reason == NO_MATCH and decision.matched_blocks == 0


def test_an_overloaded_holder_loses_the_prompt_to_the_least_loaded() -> None:
    keys = _keys(PROMPT)
    within = [_view("a", load=2, holds=PROMPT), _view("b", load=0)]
    assert choose_replica(within, keys, KNOBS).reason == AFFINITY  # a gap of 2 is not past balance_abs
    past = choose_replica([_view("a", load=3, holds=PROMPT), _view("b", load=0)], keys, KNOBS)
    assert (past.replica_id, past.reason) == ("b", BALANCE)
    relative = [_view("a", load=12, holds=PROMPT), _view("b", load=9)]  # gap 3 but only 1.33 times
    assert choose_replica(relative, keys, KNOBS).reason == AFFINITY


def test_new_conversations_spread_over_the_replicas() -> None:
    busy_cache = _view("a", holds=list(range(500, 564)))
    assert choose_replica([busy_cache, _view("b")], _keys(PROMPT), KNOBS).replica_id == "b"  # fewer blocks held
    assert choose_replica([_view("a", load=1), _view("b", load=0)], _keys(PROMPT), KNOBS).replica_id == "b"
    tied = [_view("a", routed=3), _view("b", routed=2)]
    assert choose_replica(tied, _keys(PROMPT), KNOBS).replica_id == "b"
    assert choose_replica(tied, [], KNOBS).reason == NO_MATCH  # a prompt shorter than a block


def test_a_small_shared_prefix_is_no_match() -> None:
    views = [_view("a", holds=PROMPT[:16]), _view("b")]  # one block of four: under min_match
    decision = choose_replica(views, _keys(PROMPT), RoutingKnobs(min_match=0.5))
    assert decision.reason == NO_MATCH and decision.replica_id == "b"


def test_a_prefix_on_a_nodes_disk_counts_as_a_partial_match() -> None:
    keys = _keys(PROMPT)
    on_disk = ReplicaView("a", 0, set(keys[:1]), 0, on_disk=set(keys))  # one block in RAM, all four on disk
    in_ram = _view("b", holds=PROMPT[:32])  # two blocks in RAM
    decision = choose_replica([on_disk, in_ram], keys, KNOBS)
    assert (decision.replica_id, decision.matched_blocks) == ("a", 1 + 0.5 * 3)
    assert choose_replica([on_disk, _view("b", holds=PROMPT[:48])], keys, KNOBS).replica_id == "b"


def test_a_prompt_sent_before_the_last_report_still_counts() -> None:
    keys = _keys(PROMPT)
    sent_there = ReplicaView("a", 0, set(), 0, sent=set(keys[:3]))  # no report shows it yet
    decision = choose_replica([sent_there, _view("b")], keys, KNOBS)
    assert (decision.replica_id, decision.reason, decision.matched_blocks) == ("a", AFFINITY, 3)
