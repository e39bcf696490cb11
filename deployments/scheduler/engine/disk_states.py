"""The engine's side of the disk prompt-state store (`learn_conversations`): what to write, when to restore.

Every prompt state the engine keeps in RAM (a finished request's named blocks: the conversation so far,
its reply's full blocks, shared prefixes) is queued for disk and written while the engine is idle, one
piece (at most 16 MiB) per idle turn. A request whose prompt continues past what RAM holds, along blocks
the store holds, reads them back into the paged KV before its prompt pass, when reading is estimated to
take less time than prefilling those tokens (both rates measured on this machine). A hybrid model's state
snapshots go with the blocks they end at, and its prompts resume only where one is stored
(disk_snapshots.py). The store itself (the PromptStore actor) does the disk I/O; `StoreLink` is how the
engine reaches it from where it runs. The engine holds one `DiskStates` (None when the store is off) and
makes its calls: a restore on admission, the imprint routes' queries, a piece per idle turn, the remaining
writes on a planned stop.
"""

import logging
import math
import time
from collections import deque
from dataclasses import replace

import numpy as np

from deployments.config import EngineConfig
from deployments.messages.prefix import KEY_BYTES, PromptHashes
from deployments.messages.replies import ImprintAnswer
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.store import (
    BlockRows,
    DeleteSet,
    LookUp,
    OpenSet,
    PieceWrite,
    ReadRows,
    ReadStats,
    StoreStats,
    StoreUnavailable,
)
from deployments.prompt_store.failures import FailureBurst, StoreFailedError
from deployments.prompt_store.identity import CONVERSATIONS, PREFIXES, set_id
from deployments.prompt_store.links import STORE_FLUSH_S, StoreLink
from deployments.prompt_store.store import PIECE_BYTES
from deployments.scheduler.engine.disk_snapshots import DiskSnapshots
from deployments.scheduler.engine.disk_types import BlockRowsIO, Resumable
from deployments.scheduler.engine.kv_blocks import BlockManager, BlockTable
from deployments.scheduler.engine.state_slots import StateSlots

log = logging.getLogger("tensorfold.store")
STOP_WRITES_S = 15.0  # of a planned stop's 20 s (docs/store.md): the store's flush comes after
FIRST_READ_BYTES_PER_S = 200e6  # until a read is measured: a cautious local disk
FIRST_PREFILL_TOKENS_PER_S = 1000.0  # until a prompt pass is measured
RATE_WEIGHT = 0.3  # of each new measurement in the running estimates
STORE_RETRY_S = 2.0  # after a failed call, the set's index is asked for again no sooner
DELETE_REFUSED = "the prompt store is not available (it restarts after a failure): nothing was deleted; try again"


class DiskStates:
    def __init__(
        self,
        link: StoreLink,
        set_id: str,
        blocks: BlockManager,
        rows: BlockRowsIO,
        block_bytes: int,
        snapshots: DiskSnapshots | None = None,
        shared: bool = False,
    ) -> None:
        self.link, self.set_id = link, set_id
        self.shared = shared  # learn_shared: other nodes write to the folder too (look_further)
        self.blocks, self.rows, self.block_bytes = blocks, rows, block_bytes
        self.snapshots = snapshots  # a hybrid model's state snapshots (None: an attention-only model)
        self._on_disk: set[bytes] | None = None  # opened on first use (the link may not answer before then)
        self._queue: deque[tuple[bytes | None, bytes, int, tuple[int, ...]]] = deque()  # (parent, name, id, tokens)
        self.read_rate = FIRST_READ_BYTES_PER_S
        self.prefill_rate = FIRST_PREFILL_TOKENS_PER_S
        self.restored_tokens_total = 0
        self.latest: StoreStats | None = None  # the store's figures for this set, refreshed while idle
        self.stats_stale = True
        self.version = 0  # counts changes to `on_disk`, for the router's digest
        self.failures = FailureBurst("prompt store", "states stay in RAM only and prompts prefill until it answers")
        self._retry_at = 0.0  # after a failed call: when the index may be asked for again (time.monotonic())
        self._lost_seen = 0  # writes the store reported failed or skipped, when last compared

    @classmethod
    def open(
        cls,
        config: EngineConfig,
        link: StoreLink | None,
        blocks: BlockManager,
        rows: BlockRowsIO,
        dtype: str,
        device: str,
        states: tuple[StateSlots, int] | None = None,
    ) -> "DiskStates":
        """The engine's states in its model's set: one per checkpoint, dtype, KV (and state) layout and kind
        of state. `states`: a hybrid model's slots and the bytes of one snapshot."""
        if link is None:
            raise ValueError("learn needs the node's prompt store")
        token_bytes = rows.kv_bytes_per_token()
        layout = f"{token_bytes}B-per-token/b{config.block_size}" + ("" if states is None else f"/s{states[1]}")
        kind = CONVERSATIONS if config.learn_conversations else PREFIXES
        store_set = set_id(config.model, dtype, layout, config.tensor_parallel_size, device, kind)
        snapshots = None if states is None else DiskSnapshots(states[0], rows, states[1])
        return cls(link, store_set, blocks, rows, token_bytes * config.block_size, snapshots, config.learn_shared)

    @property
    def on_disk(self) -> set[bytes]:
        """The blocks the store holds, from its index (asked for on first use and again after the store
        failed or turned writes away: empty, and not kept, while it does not answer)."""
        if self._on_disk is None:
            if time.monotonic() < self._retry_at:
                return set()
            try:
                held = self.link.ask(OpenSet(self.set_id))
            except Exception as exc:
                self._store_failed(exc)
                return set()
            self._on_disk = set(held.blocks)
            if self.snapshots is not None:
                self.snapshots.on_disk = set(held.states)
            self.version += 1
        return self._on_disk

    def _store_failed(self, exc: Exception) -> None:
        """A call the store did not answer (or refused): logged once per burst, and nothing is claimed from
        disk until its index is read again (writes sent meanwhile may be lost)."""
        if not isinstance(exc, (StoreFailedError, OSError)):  # not the store's failure: a bug, with its traceback
            log.error("prompt store: a call failed unexpectedly", exc_info=exc)
        self.failures.failed("unavailable", str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        self._retry_at = time.monotonic() + STORE_RETRY_S
        self.latest = replace(self.latest or StoreStats(), available=False, unavailable_reason=str(exc)[:300])
        if self._on_disk is not None:
            self._on_disk = None
            self.version += 1

    def store_answers(self) -> bool:
        """Ask the store for its figures now: whether it answers (the imprint routes claim disk tokens only
        then). Failed or refused writes seen since the last question send the engine back to its index."""
        try:
            self.refresh_stats()
        except Exception as exc:
            self._store_failed(exc)
            return False
        return True

    # ---- the engine's calls ---------------------------------------------------------------------------
    def restore_prompt(self, request: EngineRequest) -> int:
        """Tokens of a new request's prompt read back from disk (0 when RAM holds as much, a read does not
        pay, or it fails)."""
        hashes = request.prompt_hashes or PromptHashes.of(
            request.prompt_token_ids, self.blocks.block_size, request.images
        )
        return self.restore_guarded(request.prompt_token_ids, hashes)

    def restore_guarded(self, prompt: list[int], hashes: PromptHashes) -> int:
        try:
            return self.restore(prompt, hashes)
        except Exception as exc:  # the store failing costs a prompt pass, never the request
            self._store_failed(exc)
            return 0

    def imprint(self, query: ImprintQuery) -> ImprintAnswer:
        """The imprint routes' answer for a rendered conversation (loading its disk state first if asked)."""
        prompt = query.prompt_token_ids
        hashes = query.prompt_hashes or PromptHashes.of(prompt, self.blocks.block_size, query.images)
        if not query.load:
            return self.answer(prompt, hashes)
        started = time.perf_counter()
        loaded = self.restore_guarded(prompt, hashes)
        answer = self.answer(prompt, hashes)
        answer.loaded_tokens, answer.load_seconds = loaded, round(time.perf_counter() - started if loaded else 0.0, 6)
        return answer

    def has_idle_work(self) -> bool:
        """States waiting for disk: written one piece per idle turn, so a new request waits for one piece."""
        return self.has_writes() or self.stats_stale

    def idle_work(self) -> None:
        try:
            if self.has_writes():
                self.write_one()
            else:  # after the writes: the store's figures for /metrics and /health
                self.refresh_stats()
        except Exception as exc:  # the store failing costs its states, never the engine: they stay in RAM only
            self._store_failed(exc)
            self.stats_stale = False

    def write_waiting(self, deadline: float = math.inf) -> None:
        """Write every waiting piece, then refresh the figures, while time.monotonic() is before `deadline`."""
        while self.has_idle_work() and time.monotonic() < deadline:
            self.idle_work()

    def finish_writes(self) -> None:
        """A planned stop writes what is waiting, within STOP_WRITES_S, then waits for the store to have it
        (writes are sent without waiting: the process must not exit before the store has read them)."""
        self.write_waiting(time.monotonic() + STOP_WRITES_S)
        self.link.flush(STORE_FLUSH_S)

    # ---- writes ---------------------------------------------------------------------------------------
    def remember(self, chain: list[tuple[bytes, int, tuple[int, ...]]]) -> None:
        """Queue a sequence's named blocks that the store does not hold yet (or whose snapshot it lacks)."""
        parent: bytes | None = None
        for name, block_id, tokens in chain:
            if name not in self.on_disk or self._state_waiting(name):
                self._queue.append((parent, name, block_id, tokens))
            parent = name

    def _state_waiting(self, name: bytes) -> bool:
        return self.snapshots is not None and self.snapshots.waiting(name)

    @property
    def _state_bytes(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.state_bytes

    def disk_keys(self) -> bytes:
        """The keys of the blocks the store holds for this set (none before it is opened), for the router."""
        return b"".join(name[:KEY_BYTES] for name in self._on_disk or ())

    def has_writes(self) -> bool:
        return bool(self._queue)

    def refresh_stats(self) -> None:
        """The store's figures; writes it failed or turned away since the last look mean the engine's
        optimistic `on_disk` may claim blocks it lacks, so the index is read again."""
        _ = self.on_disk  # the set is opened before the store has figures for it
        latest = self.link.ask(ReadStats(self.set_id))
        self.latest, self.stats_stale = latest, False
        self.failures.succeeded()
        lost = sum(latest.write_failures.values()) + latest.writes_skipped
        if lost != self._lost_seen and self._on_disk is not None:
            self._on_disk = None  # a restarted store counts from 0 again: any change is a reason to look
            self.version += 1
        self._lost_seen = lost

    def write_one(self) -> None:
        """Send one piece of queued blocks still held in RAM, with the snapshots RAM holds at them (called
        while the engine is idle, so no step is writing either)."""
        run: list[tuple[bytes | None, bytes, int, tuple[int, ...]]] = []
        states: list[bytes] = []  # snapshots ending at blocks of the run or already stored
        room = PIECE_BYTES
        while self._queue:
            entry = self._queue.popleft()
            parent, name, block_id, _ = entry
            block = name not in self.on_disk and self.blocks.still_holds(name, block_id)
            state = self._state_waiting(name) and (block or name in self.on_disk)  # never without its block
            if not block and not state:
                continue  # stored meanwhile, or evicted from RAM before its turn
            size = block * self.block_bytes + state * self._state_bytes
            if (run or states) and (size > room or (block and run and parent != run[-1][1])):
                self._queue.appendleft(entry)  # a piece is one run of a chain, at most PIECE_BYTES
                break
            room -= size
            if block:
                run.append(entry)
            if state:
                states.append(name)
        if run or states:
            self._send(run, states)

    def _send(self, run: list[tuple[bytes | None, bytes, int, tuple[int, ...]]], states: list[bytes]) -> None:
        ids = [block_id for _, _, block_id, _ in run]
        payload = self.rows.read_block_rows(ids).reshape(-1) if ids else np.zeros(0, dtype=np.uint8)
        piece = PieceWrite(
            self.set_id,
            run[0][0] if run else None,
            [name for _, name, _, _ in run],
            [list(tokens) for *_, tokens in run],
            self.block_bytes,
            payload,
            None if not states or self.snapshots is None else self.snapshots.rows_of(states),
        )
        self.link.write(piece)
        self.stats_stale = True
        self.on_disk.update(piece.hashes)  # optimistic: a cap may refuse it, and a later read then misses
        if self.snapshots is not None:
            self.snapshots.on_disk.update(states)
        self.version += 1

    # ---- reads ----------------------------------------------------------------------------------------
    def resumable(self, prompt: list[int], hashes: PromptHashes, from_disk: bool = True) -> Resumable:
        """RAM's and disk's longest kept state for this prompt (leaving its last token to compute;
        `from_disk` False: RAM's alone)."""
        bs = self.blocks.block_size
        usable = (len(prompt) - 1) // bs
        ram = len(self.blocks.match_prefix(prompt, len(prompt) - 1, hashes))
        held = self.on_disk if from_disk else set()
        disk = 0
        while disk < usable and hashes.hashes[disk] in held:
            disk += 1
        if from_disk and self.shared and max(ram, disk) < usable:
            disk = self._look_further(hashes.hashes[:usable], disk)
        if self.snapshots is not None:
            return self._resumable_hybrid(len(prompt), hashes.hashes[:usable], ram, disk)
        extra = max(0, disk - ram)
        return self._plan(len(prompt), ram, disk, extra * self.block_bytes, ram)

    def _resumable_hybrid(self, tokens: int, names: list[bytes], ram: int, disk: int) -> Resumable:
        """A hybrid prompt resumes only at a block with a snapshot (disk_snapshots.py): the blocks past
        RAM's are read, and the snapshot too unless RAM holds it."""
        assert self.snapshots is not None
        from_ram, end, state_at = self.snapshots.resume_points(names, ram, disk)
        size = max(0, end - ram) * self.block_bytes + (0 if state_at is None else self._state_bytes)
        plan = self._plan(tokens, from_ram, end, size, min(ram, end))
        plan.state_at = state_at
        return plan

    def _look_further(self, names: list[bytes], known: int) -> int:
        """A shared folder: ask the store for the prompt's blocks past the `known` ones this engine knows
        are on disk (another node's store may have written them); returns the run the store holds."""
        try:
            held = self.link.ask(LookUp(self.set_id, names, self.snapshots is not None))
        except Exception as exc:  # the store failing costs a prompt pass, never the request
            self._store_failed(exc)
            return 0
        if len(held.blocks) > known:
            self.on_disk.update(held.blocks)
            if self.snapshots is not None:
                self.snapshots.on_disk.update(held.states)
            self.version += 1
        return max(known, len(held.blocks))

    def _plan(self, tokens: int, ram: int, disk: int, size: int, read_from: int) -> Resumable:
        bs = self.blocks.block_size
        prefill = max(0, disk - ram) * bs / self.prefill_rate
        return Resumable(tokens, ram * bs, disk * bs, size, size / self.read_rate, prefill, read_from)

    def restore(self, prompt: list[int], hashes: PromptHashes) -> int:
        """Read the prompt's disk state past RAM's into the cache when that pays; returns tokens restored."""
        plan = self.resumable(prompt, hashes)
        if not plan.worth_reading:
            return 0
        bs = self.blocks.block_size
        start, end = plan.read_from, plan.disk_tokens // bs
        pin = BlockTable()  # RAM's part of the state stays while room is made for the disk's part
        self.blocks.adopt_prefix(pin, prompt, start * bs, hashes)
        try:
            if end - start > self.blocks.num_available:
                return 0
            rows = self.link.ask(ReadRows(self.set_id, hashes.hashes[start:end], plan.state_at))
            if rows is not None:
                state_size = 0 if rows.state is None else len(rows.state.payload)
                self._measured_read(len(rows.payload) + state_size, rows.read_seconds)
            restored = self._read_into_cache(prompt, hashes, start, end, rows)
            if self.snapshots is None:
                return restored
            if restored < (end - start) * bs or not self.snapshots.restore(plan.state_at, rows):
                return 0  # no snapshot at the end of the blocks read: they only wait cached
            self.restored_tokens_total += plan.disk_tokens - plan.ram_tokens
            self.stats_stale = True
            return plan.disk_tokens - plan.ram_tokens
        finally:
            self.blocks.release(pin)

    def _read_into_cache(
        self, prompt: list[int], hashes: PromptHashes, start: int, end: int, rows: BlockRows | None
    ) -> int:
        """The blocks read into the cache, named: the tokens they hold."""
        bs = self.blocks.block_size
        if end <= start:
            return 0
        if rows is None or not rows.hashes:
            self._forget_missing(hashes.hashes[start:end])
            return 0
        if len(rows.hashes) < end - start:  # a damaged or evicted piece: the rest prefills
            self._forget_missing(hashes.hashes[start + len(rows.hashes) : end])
        count = len(rows.hashes)
        expected = [prompt[(start + i) * bs : (start + i + 1) * bs] for i in range(count)]
        if [list(t) for t in rows.token_ids] != expected:  # names collide only with other tokens: refuse
            log.warning("prompt store: stored tokens differ from the prompt's; prefilling instead")
            return 0
        block_ids = self.blocks.take_for_restore(count)
        self.rows.write_block_rows(block_ids, rows.payload.reshape(count, self.block_bytes))
        for block_id, name, tokens in zip(block_ids, rows.hashes, expected):
            self.blocks.name_restored(block_id, name, tokens)
        if self.snapshots is None:
            self.restored_tokens_total += count * bs
        self.stats_stale = True
        return count * bs

    def _forget_missing(self, names: list[bytes]) -> None:
        self.on_disk.difference_update(names)
        self.version += 1

    def _measured_read(self, size: int, seconds: float) -> None:
        if seconds > 0:
            self.read_rate = (1 - RATE_WEIGHT) * self.read_rate + RATE_WEIGHT * size / seconds

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.blocks.block_size and seconds > 0:
            self.prefill_rate = (1 - RATE_WEIGHT) * self.prefill_rate + RATE_WEIGHT * tokens / seconds

    def answer(self, prompt: list[int], hashes: PromptHashes) -> ImprintAnswer:
        """Where this prompt would resume from, and the estimated wait before its first token (no disk
        tokens while the store does not answer: they could not be read)."""
        plan = self.resumable(prompt, hashes, from_disk=self.store_answers())
        from_disk = plan.worth_reading
        resumed = plan.disk_tokens if from_disk else plan.ram_tokens
        wait = (plan.read_seconds if from_disk else 0.0) + (plan.tokens - resumed) / self.prefill_rate
        source = "disk" if from_disk else ("ram" if plan.ram_tokens else "none")
        return ImprintAnswer(
            plan.tokens,
            plan.ram_tokens,
            plan.disk_tokens,
            plan.disk_bytes if from_disk else 0,
            source,
            round(wait, 6),
            disk=True,
        )

    def forget_all(self) -> int | StoreUnavailable:
        """DELETE /v1/imprint: the set's states on disk go (RAM's stay until evicted); StoreUnavailable
        when the store did not do it (the route answers 503)."""
        try:
            freed = self.link.ask(DeleteSet(self.set_id))
        except Exception as exc:
            self._store_failed(exc)
            return StoreUnavailable(DELETE_REFUSED)
        self._queue.clear()
        self._on_disk = set()
        self.stats_stale = True
        self.version += 1
        return freed
