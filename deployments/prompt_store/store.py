"""The prompt-state store on disk, pure (the PromptStore actor wraps it): sets, pieces, caps, checks.

Layout under the learn folder (0700 folders, 0600 files):
  written            today's date and the bytes written today (the daily cap)
  clock              the sets, least recently opened first (other sets go first when the cap needs room)
  <set id>/used      when this set was last opened
  <set id>/*.piece   runs of blocks (files.py), named by their first block; each block stored once per set
  <set id>/*.state   hybrid models: a state snapshot, named by the block it ends at (which the set holds)
A set is one checkpoint identity, dtype, KV layout, parallel shape and kernel build (identity.py).
"""

import contextlib
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from deployments.messages.store import BlockRows, PieceWrite, SetIndex, StateRows, StoreCaps, StoreStats
from deployments.prompt_store.entries import Piece, SetEntry, StateFile
from deployments.prompt_store.failures import FailureBurst, failure_reason
from deployments.prompt_store.files import (
    PIECE_SUFFIX,
    STATE_SUFFIX,
    DamagedPiece,
    decode_piece,
    encode_piece,
    read_file,
    read_header,
    remove_temp_files,
    secure_dir,
    write_file_atomically,
)
from deployments.prompt_store.shared_folder import look_in_folder

log = logging.getLogger("tensorfold.store")
PIECE_BYTES = 16 << 20  # a piece's payload at most: what a request arriving during a write waits for
PREFIX_SET_SUFFIX = "-prefixes"  # identity.PREFIXES: a plain --learn store's sets, the first to go


class PromptStoreFiles:
    def __init__(self, root: Path, caps: StoreCaps) -> None:
        self.root = secure_dir(Path(root).expanduser())
        self.caps = caps
        self._sets: dict[str, SetEntry] = {}
        self._skip_logged: set[str] = set()
        self.failures = FailureBurst("prompt store: writing to disk", "states stay in RAM only")
        remove_temp_files(self.root)

    # ---- sets -----------------------------------------------------------------------------------------
    def open_set(self, set_id: str) -> SetIndex:
        """Index a set's pieces and states (headers only) and stamp it used; returns the names it holds."""
        entry = self._entry(set_id)
        try:  # a stamp that cannot be written costs the eviction order, never the set
            write_file_atomically(entry.folder / "used", f"{time.time():.3f}\n".encode())
            self._touch_clock(set_id)
        except OSError as exc:
            self.failures.failed(failure_reason(exc), str(exc))
        return SetIndex(list(entry.blocks), list(entry.states))

    def _entry(self, set_id: str) -> SetEntry:
        """The set's index, built from its folder on first use (after a restart, the first call may be a
        write or a read: the index is rebuilt from what is on disk either way)."""
        if set_id not in self._sets:
            self._sets[set_id] = self._load_set(secure_dir(self.root / set_id))
        return self._sets[set_id]

    def _load_set(self, folder: Path) -> SetEntry:
        """Every complete piece is indexed; temp files a crash left mid-write and damaged pieces go, so
        the folder holds no piece the index does not."""
        remove_temp_files(folder)
        entry = SetEntry(folder)
        for path in sorted(folder.glob(f"*{PIECE_SUFFIX}")):
            try:
                header = read_header(path)
            except DamagedPiece as exc:
                log.warning("prompt store: deleting a damaged piece: %s", exc)
                path.unlink(missing_ok=True)
                continue
            info = path.stat()  # once: a start-up over many pieces pays one call per piece
            entry.add(Piece(path, header.parent, header.hashes, info.st_size, info.st_mtime))
        self._index_states(entry)
        return entry

    def _index_states(self, entry: SetEntry) -> None:
        """A state file whose block the set no longer holds can never be used: it goes."""
        for path in sorted(entry.folder.glob(f"*{STATE_SUFFIX}")):
            try:
                (name,) = read_header(path).hashes
            except (DamagedPiece, ValueError) as exc:
                log.warning("prompt store: deleting a damaged state: %s", exc)
                path.unlink(missing_ok=True)
                continue
            if name in entry.blocks:
                entry.states[name] = StateFile(path, path.stat().st_size)
                entry.stats.bytes_held += entry.states[name].size
            else:
                path.unlink(missing_ok=True)

    def lookup(self, set_id: str, hashes: list[bytes], with_states: bool = False) -> SetIndex:
        """The leading run of `hashes` the set holds (with_states: and the snapshots at them), looking in the
        folder past what the index holds (shared_folder.py)."""
        return look_in_folder(self._entry(set_id), hashes, with_states)

    def delete_set(self, set_id: str) -> int:
        """Forget a set's states: its pieces go, its folder and `used` stamp stay. Returns the bytes freed."""
        entry = self._sets.get(set_id) or self._sets.setdefault(set_id, SetEntry(secure_dir(self.root / set_id)))
        freed = 0
        for path in _stored_files(entry.folder):
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
        entry.pieces.clear()
        entry.blocks.clear()
        entry.states.clear()
        entry.stats.bytes_held = 0
        return freed

    def stats(self, set_id: str) -> StoreStats:
        """The set's figures, with the store's write failures by reason (in-process, the live object)."""
        entry = self._entry(set_id)
        entry.stats.write_failures = dict(self.failures.counts)
        return entry.stats

    # ---- writes ---------------------------------------------------------------------------------------
    def write(self, piece: PieceWrite) -> list[bytes]:
        """Store the blocks the set does not hold yet, then the piece's states whose blocks it now holds;
        returns the block names now stored ([] if a cap said no or the disk failed: counted, logged once
        per burst, and no partial file stays)."""
        try:
            written = self._write_blocks(piece)
            if piece.states is not None:
                self._write_states(piece.set_id, piece.states)
        except OSError as exc:
            self.failures.failed(failure_reason(exc), str(exc))
            return []
        self.failures.succeeded()
        return written

    def _write_blocks(self, piece: PieceWrite) -> list[bytes]:
        entry = self._entry(piece.set_id)
        keep = [i for i, h in enumerate(piece.hashes) if h not in entry.blocks]
        if not keep:
            return []
        rows = piece.payload.reshape(len(piece.hashes), piece.block_bytes)[keep]
        parent = piece.parent if keep[0] == 0 else piece.hashes[keep[0] - 1]
        data = encode_piece(
            parent,
            [piece.hashes[i] for i in keep],
            [piece.token_ids[i] for i in keep],
            rows.tobytes(),
            piece.block_bytes,
        )
        if not self._room_for(piece.set_id, len(data)):
            entry.stats.writes_skipped += 1
            return []
        path = entry.folder / f"{piece.hashes[keep[0]].hex()}{PIECE_SUFFIX}"
        _write_indexed_file(path, data)
        entry.add(Piece(path, parent, [piece.hashes[i] for i in keep], len(data), time.time()))
        entry.stats.pieces_written += 1
        self._count_written(len(data))
        return [piece.hashes[i] for i in keep]

    def _write_states(self, set_id: str, states: StateRows) -> None:
        """Each snapshot once per set, only beside its block (a state without its KV rows is never read)."""
        entry = self._entry(set_id)
        rows = states.payload.reshape(len(states.names), states.state_bytes)
        for name, row in zip(states.names, rows):
            if name in entry.states or name not in entry.blocks:
                continue
            data = encode_piece(None, [name], [[]], row.tobytes(), states.state_bytes)
            if not self._room_for(set_id, len(data), keep_piece=entry.blocks[name][0]):
                entry.stats.writes_skipped += 1
                continue
            path = entry.folder / f"{name.hex()}{STATE_SUFFIX}"
            _write_indexed_file(path, data)
            entry.states[name] = StateFile(path, len(data))
            entry.stats.bytes_held += len(data)
            entry.stats.states_written += 1
            self._count_written(len(data))

    def _room_for(self, set_id: str, size: int, keep_piece: str | None = None) -> bool:
        """Whether `size` more bytes may be written now, making room under the total cap if needed (never by
        evicting `keep_piece`: a snapshot's own block)."""
        day, written = self._written_today()
        if written + size > self.caps.daily_bytes:
            return self._skip("daily", f"the daily write cap ({self.caps.daily_bytes} bytes) is reached")
        if shutil.disk_usage(self.root).free - size < self.caps.min_free_bytes:
            return self._skip("free", f"less than {self.caps.min_free_bytes} bytes of disk would stay free")
        while self._total_bytes() + size > self.caps.max_bytes:
            if not self._evict_one(set_id, keep_piece):
                return self._skip("total", f"the store's cap ({self.caps.max_bytes} bytes) is reached")
        return True

    def _skip(self, kind: str, why: str) -> bool:
        if kind not in self._skip_logged:  # one line per cause: states stay in RAM only, replies do not change
            log.warning("prompt store: not writing to disk: %s; states stay in RAM only", why)
            self._skip_logged.add(kind)
        return False

    def _evict_one(self, keep_set: str, keep_piece: str | None = None) -> bool:
        """Delete one thing: another set's folder contents first (plain --learn prefix sets, then the least
        recently opened), then this set's least recently used piece (a chain's tail before its prefix)."""
        for other in sorted(self._clock(), key=lambda name: not name.endswith(PREFIX_SET_SUFFIX)):
            if other != keep_set and any(_stored_files(self.root / other)):
                self.delete_set(other)
                return True
        entry = self._sets[keep_set]
        candidates = [name for name in entry.pieces if name != keep_piece]
        if not candidates:
            return False
        name = min(candidates, key=lambda n: (entry.pieces[n].used, -len(self._depth(entry, n))))
        self._drop(entry, name)
        return True

    # ---- reads ----------------------------------------------------------------------------------------
    def read(self, set_id: str, hashes: list[bytes], state_at: bytes | None = None) -> BlockRows | None:
        """The longest leading run of `hashes` the set holds, every piece checked, and the state snapshot
        named `state_at` when every asked block was found (hybrid models); None if it holds neither."""
        started = time.perf_counter()
        entry = self._entry(set_id)
        rows: list[np.ndarray] = []
        tokens: list[list[int]] = []
        found: list[bytes] = []
        cache: dict[str, tuple[list[list[int]], np.ndarray]] = {}
        for name in hashes:
            where = entry.blocks.get(name)
            if where is None:
                break
            piece_name, index = where
            if piece_name not in cache:
                loaded = self._load(entry, piece_name)
                if loaded is None:
                    break
                cache[piece_name] = loaded
            piece_tokens, payload = cache[piece_name]
            if index >= len(piece_tokens):  # another store replaced the file with a shorter run of the chain
                break
            rows.append(payload[index])
            tokens.append(piece_tokens[index])
            found.append(name)
        state = None if state_at is None or len(found) < len(hashes) else self._load_state(entry, state_at)
        if not found and state is None:
            return None
        entry.stats.pieces_read += len(cache)
        entry.stats.blocks_read += len(found)
        payload = np.concatenate(rows) if rows else np.zeros(0, dtype=np.uint8)
        return BlockRows(found, tokens, payload, time.perf_counter() - started, state)

    def _load_state(self, entry: SetEntry, name: bytes) -> StateRows | None:
        stored = entry.states.get(name)
        if stored is None:
            return None
        try:
            header, payload = decode_piece(stored.path)
            if header.hashes != [name]:
                raise DamagedPiece(f"{stored.path.name}: it names another block")
        except (DamagedPiece, OSError) as exc:
            log.warning("prompt store: %s; deleting it", exc)
            entry.stats.damaged_pieces += 1
            self._drop_state(entry, name)
            return None
        entry.stats.states_read += 1
        return StateRows([name], header.block_bytes, np.frombuffer(payload, dtype=np.uint8))

    def _load(self, entry: SetEntry, piece_name: str) -> tuple[list[list[int]], np.ndarray] | None:
        piece = entry.pieces[piece_name]
        try:
            header, payload = decode_piece(piece.path)
        except (DamagedPiece, OSError) as exc:
            log.warning("prompt store: %s; deleting it and the states that need it", exc)
            entry.stats.damaged_pieces += 1
            self._drop_with_dependents(entry, piece_name)
            return None
        piece.used = time.time()
        return header.token_ids, np.frombuffer(payload, dtype=np.uint8).reshape(len(header.hashes), -1)

    # ---- bookkeeping ----------------------------------------------------------------------------------
    def _drop(self, entry: SetEntry, name: str) -> None:
        piece = entry.pieces.pop(name)
        piece.path.unlink(missing_ok=True)
        for block in piece.hashes:
            if entry.blocks.get(block, (None,))[0] == name:
                del entry.blocks[block]
                self._drop_state(entry, block)  # a snapshot is useless without the block it ends at
        entry.stats.bytes_held -= piece.size

    def _drop_state(self, entry: SetEntry, name: bytes) -> None:
        stored = entry.states.pop(name, None)
        if stored is not None:
            stored.path.unlink(missing_ok=True)
            entry.stats.bytes_held -= stored.size

    def _drop_with_dependents(self, entry: SetEntry, name: str) -> None:
        """A damaged piece and every piece continuing a chain through it (they can never be reached)."""
        doomed, names = {name}, set(entry.pieces[name].hashes)
        changed = True
        while changed:
            changed = False
            for other, piece in entry.pieces.items():
                if other not in doomed and piece.parent in names:
                    doomed.add(other)
                    names.update(piece.hashes)
                    changed = True
        for other in doomed:
            self._drop(entry, other)

    def _depth(self, entry: SetEntry, name: str) -> list[bytes]:
        """The chain of block names before a piece, as far as the set holds it (for eviction order)."""
        chain: list[bytes] = []
        parent = entry.pieces[name].parent
        while parent is not None and parent in entry.blocks and len(chain) < 1 << 16:
            chain.append(parent)
            parent = entry.pieces[entry.blocks[parent][0]].parent
        return chain

    def _total_bytes(self) -> int:
        total = 0
        for folder in self.root.iterdir():
            if folder.is_dir() and not folder.is_symlink():
                total += sum(p.stat().st_size for p in _stored_files(folder))
        return total

    def _written_today(self) -> tuple[str, int]:
        today = time.strftime("%Y-%m-%d")
        try:
            body = json.loads(read_file(self.root / "written"))
            return today, int(body["bytes"]) if body.get("day") == today else 0
        except (OSError, ValueError, KeyError):
            return today, 0

    def _count_written(self, size: int) -> None:
        day, written = self._written_today()
        write_file_atomically(self.root / "written", json.dumps({"day": day, "bytes": written + size}).encode())

    def _clock(self) -> list[str]:
        try:
            return [str(s) for s in json.loads(read_file(self.root / "clock"))]
        except (OSError, ValueError):
            return []

    def _touch_clock(self, set_id: str) -> None:
        order = [s for s in self._clock() if s != set_id and (self.root / s).is_dir()] + [set_id]
        write_file_atomically(self.root / "clock", json.dumps(order).encode())


def _write_indexed_file(path: Path, data: bytes) -> None:
    """A piece or state file, indexed by the caller once this returns: if it fails, even after the rename
    (the folder's fsync), the file goes, so the folder never holds a piece the index does not."""
    try:
        write_file_atomically(path, data)
    except OSError:
        with contextlib.suppress(OSError):  # the original error is the one to report
            path.unlink(missing_ok=True)
        raise


def _stored_files(folder: Path) -> list[Path]:
    """A set folder's pieces and state files (what counts in the caps)."""
    return [*folder.glob(f"*{PIECE_SUFFIX}"), *folder.glob(f"*{STATE_SUFFIX}")]
