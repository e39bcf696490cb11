"""The disk store when writes fail (a full disk, a file-size limit) and when it is reopened after a crash:
failures are counted by reason and logged once per burst, and no piece stays that the index does not hold."""

import logging
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deployments.messages.prefix import PromptHashes
from deployments.messages.store import PieceWrite, StoreCaps
from deployments.prompt_store.failures import NO_SPACE, FailureBurst
from deployments.prompt_store.store import PromptStoreFiles

BIG = StoreCaps(max_bytes=1 << 40, min_free_bytes=0, daily_bytes=1 << 40)


def _piece(tokens: list[int], block_bytes: int) -> PieceWrite:
    hashes = PromptHashes.of(tokens, 4).hashes
    payload = np.random.default_rng(len(tokens)).integers(0, 255, len(hashes) * block_bytes, dtype=np.uint8)
    return PieceWrite(
        "s", None, hashes, [tokens[i * 4 : (i + 1) * 4] for i in range(len(hashes))], block_bytes, payload
    )


def _files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def _index_matches_folder(store: PromptStoreFiles, folder: Path) -> None:
    """Every piece in the folder is indexed and every indexed piece is in the folder (no temp files)."""
    indexed = set(store._sets["s"].pieces)
    assert {p.name for p in folder.glob("*.piece")} == indexed
    assert not list(folder.parent.rglob("*.tmp"))
    reopened = PromptStoreFiles(folder.parent, BIG)
    assert set(reopened.open_set("s").blocks) == set(store._sets["s"].blocks)


@pytest.fixture
def file_size_limit() -> Iterator[int]:
    """Files this process writes stop at 64 KiB (EFBIG, as a quota stops them), SIGXFSZ ignored."""
    limit = 64 << 10
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_failed_writes_leave_no_partial_file_and_are_counted_and_logged_once(
    tmp_path: Path, file_size_limit: int, caplog: pytest.LogCaptureFixture
) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    caplog.set_level(logging.INFO, logger="tensorfold.store")
    small = _piece(list(range(8)), 1024)
    assert store.write(small) == small.hashes
    too_big = [_piece(list(range(100 * i, 100 * i + 8)), 40 << 10) for i in range(1, 4)]  # 80 KiB each
    for piece in too_big:
        assert store.write(piece) == []  # each stops mid-write: the temp file goes
    _index_matches_folder(store, tmp_path / "s")
    assert store.stats("s").write_failures == {NO_SPACE: 3}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no_space" in warnings[0].getMessage()  # one line for the burst
    assert not any(r.exc_info for r in caplog.records)  # never a traceback
    after = _piece(list(range(500, 508)), 1024)
    assert store.write(after) == after.hashes  # the burst ends with one INFO line
    assert [r.levelno for r in caplog.records].count(logging.INFO) == 1
    assert store.stats("s").pieces_written == 2


def _mount_tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return mounted.returncode == 0


def test_a_full_tmpfs_fails_the_write_after_the_piece_and_keeps_the_piece_indexed(tmp_path: Path) -> None:
    """A piece that fills the disk is stored, then the daily counter's update meets ENOSPC: counted, and the
    piece stays indexed (the folder never holds a piece the index does not)."""
    disk = tmp_path / "disk"
    if shutil.which("mount") is None or not _mount_tmpfs(disk, "64k"):
        pytest.skip("this machine does not let the tests mount a tmpfs (the file-size test covers the logic)")
    try:
        store = PromptStoreFiles(disk, BIG)
        store.open_set("s")
        free = shutil.disk_usage(disk).free
        piece = _piece(list(range(8)), (free - 1024) // 2)  # two blocks and a ~250-byte header: under a page left
        assert store.write(piece) == []  # the piece went in; the counter beside it did not
        assert store.stats("s").write_failures == {NO_SPACE: 1}
        assert len(list((disk / "s").glob("*.piece"))) == 1
        _index_matches_folder(store, disk / "s")
        assert store.write(_piece(list(range(50, 58)), 1024)) == []  # no room left: turned away by the cap
        assert store.stats("s").writes_skipped == 1
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_reopened_store_drops_what_a_crash_left_mid_write_and_serves_the_rest(tmp_path: Path) -> None:
    store = PromptStoreFiles(tmp_path, BIG)
    store.open_set("s")
    piece = _piece(list(range(16)), 64)
    store.write(piece)
    (tmp_path / "s" / f".{'ab' * 16}.piece.4242.tmp").write_bytes(b"half a piece")  # killed mid-write
    (tmp_path / ".clock.4242.tmp").write_bytes(b"[")
    restarted = PromptStoreFiles(tmp_path, BIG)  # a restarted actor: its first call may be a read
    rows = restarted.read("s", piece.hashes)
    assert rows is not None and rows.hashes == piece.hashes and np.array_equal(rows.payload, piece.payload)
    assert not list(tmp_path.rglob("*.tmp"))
    assert restarted.stats("s").bytes_held == sum(p.stat().st_size for p in (tmp_path / "s").glob("*.piece"))


def test_a_burst_is_said_again_only_after_the_reminder_window(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tensorfold.store")
    now = [0.0]
    burst = FailureBurst("writing", "RAM only", clock=lambda: now[0])
    for _ in range(5):
        burst.failed("no_space", "disk full")
        now[0] += 10.0
    now[0] += 60.0
    burst.failed("no_space", "disk full")
    burst.succeeded()
    said = [record.getMessage() for record in caplog.records]
    assert burst.counts == {"no_space": 6} and burst.in_burst == 0
    assert len(said) == 3 and "5 more failures since" in said[1] and "after 6 failures" in said[2]
