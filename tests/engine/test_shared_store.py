"""One learn_dir shared by several nodes' stores (`learn_shared`): a store finds the pieces another store
wrote after it indexed the folder, and an engine resumes a conversation another node's engine held."""

from pathlib import Path

import numpy as np

from deployments.messages.prefix import PromptHashes
from deployments.messages.store import PieceWrite, StoreCaps
from deployments.prompt_store.links import LocalStoreLink
from deployments.prompt_store.store import PromptStoreFiles
from tests.engine.test_prompt_store import _config, _run

BIG = StoreCaps(max_bytes=1 << 40, min_free_bytes=0, daily_bytes=1 << 40)
TOKENS = list(range(16))  # four blocks of four


def _piece(blocks: int) -> PieceWrite:
    """The chain's first `blocks` blocks; each block's rows depend on its tokens only, as KV rows do."""
    hashes = PromptHashes.of(TOKENS, 4).hashes[:blocks]
    payload = np.concatenate([np.full(64, i, dtype=np.uint8) for i in range(blocks)])
    return PieceWrite("s", None, hashes, [TOKENS[i * 4 : (i + 1) * 4] for i in range(blocks)], 64, payload)


def _two_nodes(folder: Path) -> tuple[PromptStoreFiles, PromptStoreFiles]:
    """Two nodes' stores over one shared folder, each with set "s" open."""
    stores = PromptStoreFiles(folder, BIG), PromptStoreFiles(folder, BIG)
    for store in stores:
        store.open_set("s")
    return stores


def test_a_store_finds_the_pieces_another_store_wrote_to_its_folder(tmp_path: Path) -> None:
    here, there = _two_nodes(tmp_path)
    names = _piece(4).hashes
    there.write(_piece(2))
    assert here.read("s", names) is None  # its index predates the piece
    assert here.lookup("s", names).blocks == names[:2]  # the piece named by the first block it lacked
    assert here.read("s", names).hashes == names[:2]
    there.write(_piece(4))  # the rest of the chain: a piece named by block 2
    assert here.lookup("s", names).blocks == names
    rows = here.read("s", names)
    assert rows.hashes == names and np.array_equal(rows.payload, _piece(4).payload)


def test_a_piece_rewritten_under_its_name_is_read_again(tmp_path: Path) -> None:
    here, there = _two_nodes(tmp_path)
    names = _piece(4).hashes
    here.write(_piece(2))
    there.write(_piece(4))  # it does not know `here`'s piece: the same first block, the longer run
    assert here.lookup("s", names).blocks == names  # found again through the piece holding block 1
    elsewhere = PromptStoreFiles(tmp_path / "other", BIG)
    elsewhere.open_set("s")
    elsewhere.write(_piece(1))
    piece = f"{names[0].hex()}.piece"
    (tmp_path / "other" / "s" / piece).replace(tmp_path / "s" / piece)  # now a shorter run under that name
    assert here.read("s", names).hashes == names[:1]  # the index said four blocks: the rest prefills


def test_a_conversation_moves_to_an_engine_on_another_node(served_model: str, tmp_path: Path) -> None:
    """Engine B opened the shared folder before engine A wrote the conversation; with learn_shared B
    restores it from disk and replies as a fresh prompt pass; without, B prefills it (its index is its own)."""
    from deployments.scheduler.engine.core import Engine

    prompt = [(11 * i) % 600 + 30 for i in range(200)]
    shared = _config(served_model, tmp_path, learn_shared=True)
    unshared = _config(served_model, tmp_path)
    node_b, alone = Engine(shared, LocalStoreLink(shared)), Engine(unshared, LocalStoreLink(unshared))
    for engine in (node_b, alone):
        _run(engine, [5, 6, 7] * 20, "other")  # its set is open and indexed now
    node_a = Engine(shared, LocalStoreLink(shared))
    reply, _ = _run(node_a, prompt, "a")
    node_a.disk.write_waiting()
    node_a.shutdown()
    next_turn = prompt + reply + [40, 41, 42]
    _, alone_stats = _run(alone, next_turn, "c")  # its index lacks the conversation, and it does not look
    resumed, stats = _run(node_b, next_turn, "b")
    assert stats.disk_tokens >= 0.9 * len(prompt), stats
    fresh, _ = _run(Engine(unshared.model_copy(update={"learn_conversations": False})), next_turn, "f")
    assert resumed == fresh
    assert alone_stats.disk_tokens == 0
