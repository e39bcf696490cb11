"""The disk prompt-state store: its files (checks, permissions, caps) and the engine's round trip through it."""

import json
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest

from deployments.config import EngineConfig
from deployments.messages.prefix import PromptHashes
from deployments.messages.store import PieceWrite, StateRows, StoreCaps
from deployments.prompt_store.links import LocalStoreLink
from deployments.prompt_store.store import PromptStoreFiles
from serve_app.args import AppArgs
from tests.support.requests import greedy

BIG = StoreCaps(max_bytes=1 << 40, min_free_bytes=0, daily_bytes=1 << 40)


def _piece(set_id: str, tokens: list[int], block_bytes: int = 64, seed: int = 0) -> PieceWrite:
    hashes = PromptHashes.of(tokens, 4).hashes
    payload = np.random.default_rng(seed).integers(0, 255, len(hashes) * block_bytes, dtype=np.uint8)
    blocks = [tokens[i * 4 : (i + 1) * 4] for i in range(len(hashes))]
    return PieceWrite(set_id, None, hashes, blocks, block_bytes, payload)


def test_pieces_survive_a_reopen_and_are_checked(tmp_path: Path) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    piece = _piece("s", list(range(16)))
    assert store.write(piece) == piece.hashes
    assert store.write(piece) == []  # rows already stored for the same tokens are written once
    reopened = PromptStoreFiles(tmp_path, BIG)
    assert set(reopened.open_set("s").blocks) == set(piece.hashes)
    rows = reopened.read("s", piece.hashes + [b"x" * 16])
    assert rows.hashes == piece.hashes and np.array_equal(rows.payload, piece.payload)
    assert rows.token_ids == [list(range(i, i + 4)) for i in range(0, 16, 4)]


def test_a_reopen_stats_each_piece_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    for seed in range(3):
        store.write(_piece("s", [seed * 100 + i for i in range(8)], seed=seed))
    stats: list[str] = []
    real_stat = Path.stat

    def counted(path: Path, *args, **kwargs) -> os.stat_result:
        if path.suffix == ".piece":
            stats.append(path.name)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", counted)
    reopened = PromptStoreFiles(tmp_path, BIG)
    assert len(reopened.open_set("s").blocks) == 6
    assert len(stats) == 3 and len(set(stats)) == 3, stats  # size and age from one call per piece


def test_a_damaged_piece_is_deleted_with_the_states_that_need_it(tmp_path: Path) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    first = _piece("s", list(range(8)))
    store.write(first)
    tail_tokens = list(range(8)) + [50, 51, 52, 53]
    tail = _piece("s", tail_tokens)
    tail = PieceWrite("s", first.hashes[-1], tail.hashes[2:], tail.token_ids[2:], 64, tail.payload[128:])
    store.write(tail)
    (path,) = [p for p in (tmp_path / "s").glob("*.piece") if p.name.startswith(first.hashes[0].hex())]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert store.read("s", PromptHashes.of(tail_tokens, 4).hashes) is None
    assert not list((tmp_path / "s").glob("*.piece"))  # the tail needed the damaged piece: both went
    assert store.stats("s").damaged_pieces == 1


def _stored_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.suffix in (".piece", ".state"))


def test_state_snapshots_are_stored_once_beside_their_blocks_and_checked(tmp_path: Path) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    piece = _piece("s", list(range(16)))
    names = piece.hashes
    snapshots = np.random.default_rng(3).integers(0, 255, 3 * 32, dtype=np.uint8)
    piece.states = StateRows([names[1], names[3], b"y" * 16], 32, snapshots)  # the last names no stored block
    store.write(piece)
    assert sorted(p.stem for p in (tmp_path / "s").glob("*.state")) == sorted([names[1].hex(), names[3].hex()])
    again = PieceWrite("s", names[-1], [], [], 64, np.zeros(0, np.uint8), StateRows([names[1]], 32, snapshots[:32]))
    store.write(again)  # the same name is stored once
    assert store.stats("s").states_written == 2 and store.stats("s").bytes_held == _stored_bytes(tmp_path / "s")
    reopened = PromptStoreFiles(tmp_path, BIG)
    assert set(reopened.open_set("s").states) == {names[1], names[3]}
    rows = reopened.read("s", names[:2], state_at=names[1])
    assert rows.hashes == names[:2] and np.array_equal(rows.state.payload, snapshots[:32])
    assert np.array_equal(reopened.read("s", [], state_at=names[3]).state.payload, snapshots[32:64])
    assert reopened.read("s", [*names, b"x" * 16], state_at=names[3]).state is None  # a block is missing
    (damaged,) = [p for p in (tmp_path / "s").glob("*.state") if p.stem == names[3].hex()]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    assert reopened.read("s", [], state_at=names[3]) is None and not damaged.exists()
    assert reopened.stats("s").damaged_pieces == 1 and reopened.stats("s").bytes_held == _stored_bytes(tmp_path / "s")
    (block_piece,) = (tmp_path / "s").glob("*.piece")
    block_piece.write_bytes(block_piece.read_bytes()[:-1])  # the blocks go, and the snapshot ending at one
    assert reopened.read("s", names, state_at=names[1]) is None and not list((tmp_path / "s").glob("*.state"))
    assert reopened.stats("s").bytes_held == 0


def test_state_snapshots_count_in_the_caps(tmp_path: Path) -> None:
    probe = PromptStoreFiles(tmp_path / "probe", BIG)
    probe.open_set("p")
    probe.write(_piece("p", list(range(8))))
    blocks_size = probe.stats("p").bytes_held
    store = PromptStoreFiles(tmp_path / "capped", StoreCaps(blocks_size + 100, 0, 1 << 40))
    store.open_set("s")
    piece = _piece("s", list(range(8)))
    piece.states = StateRows([piece.hashes[-1]], 256, np.ones(256, np.uint8))  # more than the 100 bytes left
    assert store.write(piece) == piece.hashes
    assert store.stats("s").writes_skipped == 1 and not list((tmp_path / "capped" / "s").glob("*.state"))
    assert store.stats("s").bytes_held == blocks_size


def test_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = PromptStoreFiles(tmp_path / "learned", BIG)
        store.open_set("s")
        store.write(_piece("s", list(range(8))))
    finally:
        os.umask(old)
    for path in [tmp_path / "learned", *(tmp_path / "learned").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "learned" / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError):
        store.open_set("linked")


def test_caps_skip_writes_and_evict_other_sets_first(tmp_path: Path) -> None:
    probe = PromptStoreFiles(tmp_path / "probe", BIG)
    probe.open_set("p")
    probe.write(_piece("p", list(range(8))))
    piece_size = probe.stats("p").bytes_held
    store = PromptStoreFiles(
        tmp_path, StoreCaps(max_bytes=int(2.5 * piece_size), min_free_bytes=0, daily_bytes=1 << 40)
    )
    store.open_set("old")
    store.write(_piece("old", list(range(8))))
    store.open_set("new")
    store.write(_piece("new", list(range(100, 108))))
    store.write(_piece("new", list(range(200, 208))))  # the total cap: the other set goes first
    assert not list((tmp_path / "old").glob("*.piece")) and (tmp_path / "old" / "used").exists()
    assert len(list((tmp_path / "new").glob("*.piece"))) == 2
    daily = PromptStoreFiles(tmp_path / "d", StoreCaps(max_bytes=1 << 40, min_free_bytes=0, daily_bytes=10))
    daily.open_set("s")
    assert daily.write(_piece("s", list(range(8)))) == [] and daily.stats("s").writes_skipped == 1
    no_room = PromptStoreFiles(
        tmp_path / "f", StoreCaps(max_bytes=1 << 40, min_free_bytes=1 << 60, daily_bytes=1 << 40)
    )
    no_room.open_set("s")  # the disk would keep less free space than asked: RAM only
    assert no_room.write(_piece("s", list(range(8)))) == [] and not list((tmp_path / "f").rglob("*.piece"))
    written = json.loads((tmp_path / "written").read_text())  # today's bytes, every set's (three pieces)
    assert written["day"] == time.strftime("%Y-%m-%d") and 2.5 * piece_size < written["bytes"] < 4 * piece_size


def _config(served_model: str, learn_dir: Path, **extra: object) -> EngineConfig:
    model_dir = str(AppArgs(model=served_model).model_dir)
    return EngineConfig(
        model=model_dir,
        context=1024,
        kv_cache_gib=0.05,
        device="cpu",
        learn_dir=str(learn_dir),
        learn_conversations=True,
        **extra,
    )


def _run(engine: object, prompt: list[int], request_id: str) -> tuple[list[int], object]:
    reply = engine.generate([greedy(request_id, prompt, 12)])[request_id]
    assert reply.finish_reason is not None and reply.stats is not None
    return reply.token_ids, reply.stats


def test_a_conversation_resumes_from_disk_after_a_restart(served_model: str, tmp_path: Path) -> None:
    from deployments.scheduler.engine.core import Engine

    prompt = [(13 * i) % 600 + 30 for i in range(300)]
    config = _config(served_model, tmp_path)
    first = Engine(config, LocalStoreLink(config))
    reply, _ = _run(first, prompt, "a")
    first.disk.write_waiting()
    first.shutdown()
    next_turn = prompt + reply + [40, 41, 42]
    restarted = Engine(config, LocalStoreLink(config))  # a fresh RAM cache over the same folder
    resumed, stats = _run(restarted, next_turn, "b")
    assert stats.disk_tokens >= 0.9 * len(prompt) and stats.cached_tokens >= stats.disk_tokens
    fresh_config = config.model_copy(update={"learn_conversations": False})
    fresh, fresh_stats = _run(Engine(fresh_config), next_turn, "c")
    assert resumed == fresh and fresh_stats.cached_tokens == 0  # the same reply as a fresh prompt pass


def test_learn_alone_keeps_only_shared_prefixes_in_a_store_of_their_own(served_model: str, tmp_path: Path) -> None:
    from deployments.scheduler.engine.core import Engine

    shared = [(7 * i) % 500 + 30 for i in range(160)]
    config = _config(served_model, tmp_path).model_copy(update={"learn_conversations": False, "learn": True})
    engine = Engine(config, LocalStoreLink(config))
    _run(engine, shared + [1, 2, 3], "a")
    engine.disk.write_waiting()
    assert engine.disk.latest.pieces_written == 0  # nothing was shared yet
    _, stats = _run(engine, shared + [4, 5, 6], "b")  # finds the first prompt's blocks cached: shared
    engine.disk.write_waiting()
    held = engine.disk.latest
    assert held.pieces_written == 1 and held.bytes_held < 1.2 * stats.cached_tokens * engine.disk.block_bytes / 16
    engine.shutdown()
    restarted = Engine(config, LocalStoreLink(config))
    _, resumed = _run(restarted, shared + [7, 8, 9], "c")
    assert resumed.disk_tokens == stats.cached_tokens
    conversations = _config(served_model, tmp_path)  # --learn-conversations: its own store, not the prefixes
    other = Engine(conversations, LocalStoreLink(conversations))
    _, fresh = _run(other, shared + [7, 8, 9], "d")
    assert fresh.disk_tokens == 0
    assert sorted(p.name.rsplit("-", 1)[-1] for p in tmp_path.iterdir() if p.is_dir()) == ["conversations", "prefixes"]


def test_states_computed_on_another_device_or_matmul_land_in_a_set_of_their_own(served_model: str) -> None:
    from deployments.prompt_store.identity import set_id

    def named(device: str) -> str:
        return set_id(str(AppArgs(model=served_model).model_dir), "float32", "64B-per-token/b16", 1, device)

    cpu = named("cpu")
    assert cpu == named("cpu")  # the same server names the same set again
    gpus = {named("cuda:NVIDIA H100:invariant"), named("cuda:NVIDIA H100:cublas"), named("cuda:NVIDIA A100:invariant")}
    assert len(gpus) == 3 and cpu not in gpus
