"""Every request the engine holds, and every change in its life (docs/engine.md, A request's life).

`Requests` is the one owner of the tables (in flight by id, waiting for a lane, running) and the only
code that changes a request's place in them: it admits, starts, preempts, advances, finishes, frees and
aborts. The planner decides which request starts, which is preempted and what a step computes; the reply
writer decides what a draw writes and reports the reply's end as a `Finish`; the stepper applies each step
through this owner. The turn's chunks wait here until the engine's loop takes them.
"""

from collections import deque
from dataclasses import dataclass

from deployments.messages.counters import EngineCounters
from deployments.messages.replies import EngineChunk, FinishReason
from deployments.scheduler.engine.disk_states import DiskStates
from deployments.scheduler.engine.kv_blocks import BlockManager
from deployments.scheduler.engine.seq_images import release_images
from deployments.scheduler.engine.sequence import SeqStatus, Sequence
from deployments.scheduler.engine.state_slots import StateSlots

KEPT_AT_END = (FinishReason.STOP, FinishReason.LENGTH)  # a reply that ended so keeps its state for the next turn


@dataclass(frozen=True)
class Finish:
    """A reply's end, as the writer (or a failed step) reports it."""

    reason: FinishReason
    error: str | None = None


class Requests:
    def __init__(
        self,
        blocks: BlockManager,
        counters: EngineCounters,
        states: StateSlots | None = None,
        disk: DiskStates | None = None,
        keep_conversations: bool = True,
    ) -> None:
        """`states`: a hybrid model's state slots; `disk`: the disk store's side (None when off), which keeps
        a finished reply's whole chain when `keep_conversations`, else only the prefix it found cached."""
        self.blocks, self.counters, self.states = blocks, counters, states
        self.disk, self.keep_conversations = disk, keep_conversations
        self._by_id: dict[str, Sequence] = {}  # admitted and not yet finished
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._outbox: deque[EngineChunk] = deque()  # chunks written since the engine last took them
        self._dropped_images: list[str] = []  # embeddings the ranks hold for sequences that left mid-image

    # ---- the tables, read only ------------------------------------------------------------------------
    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def waiting(self) -> tuple[Sequence, ...]:
        """Admitted, holding no lane (in arrival order, preempted ones last)."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Sequence, ...]:
        """Holding a lane: prefilling or decoding."""
        return tuple(self._running)

    def has_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def has_work(self) -> bool:
        """Requests in flight, or chunks not yet taken."""
        return self.has_requests() or bool(self._outbox)

    def pocket_versions(self) -> dict[str, int]:
        """Each request in flight's pocket version (living weights)."""
        return {request_id: seq.stats.pocket_version for request_id, seq in self._by_id.items()}

    # ---- a request's life ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Admitted: it waits for a lane."""
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self._by_id[seq.request_id] = seq
        self._wait(seq)

    def start(self, seq: Sequence) -> None:
        """It takes a lane, from the longest cached prefix it may resume from."""
        self._waiting.remove(seq)
        # Leave at least one token to compute so the step that reaches the end yields logits.
        # Prompt logprobs need every prompt position computed, so such a request never resumes from the cache.
        covered, limit = 0, len(seq.token_ids) - 1
        restore = None
        if not seq.request.computes_whole_prompt and self.states is not None:
            limit, restore = self._resumable(seq, limit)
        if not seq.request.computes_whole_prompt and limit > 0:
            request = seq.request
            covered = self.blocks.adopt_prefix(
                seq.block_table, seq.token_ids, limit, request.prompt_hashes, request.images
            )
        if self.states is not None:
            seq.states = self.states.start(restore)
        seq.num_computed = covered
        if seq.stats.preemptions == 0:
            seq.stats.cached_tokens = min(covered, seq.num_prompt_tokens)
        seq.status = SeqStatus.RUNNING
        self._running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """It gives its lane and blocks back; it keeps its tokens and recomputes them when started again."""
        self._running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.stats.preemptions += 1
        self._wait(seq)
        self.counters.preemptions_total += 1

    def advance(self, seq: Sequence, tokens: int) -> None:
        """`tokens` more of its tokens have their KV computed; the blocks they fill get their names."""
        seq.num_computed += tokens
        self.blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.num_computed, seq.request.images)

    def wrote(self, seq: Sequence, finish: Finish | None) -> None:
        """After the writer wrote a step's draws into its reply: what is new goes out, or the reply ends."""
        if finish is not None:
            self.finish(seq, finish)
            return
        chunk = seq.take_chunk()
        if chunk is not None:
            self._outbox.append(chunk)

    def finish(self, seq: Sequence, finish: Finish) -> None:
        """End the reply (once): keep its state for the next turn, leave every table, free its blocks,
        count it, queue its last chunk."""
        if seq.finish_reason is not None:
            return
        seq.finish_reason = finish.reason
        if finish.reason in KEPT_AT_END:
            self._keep(seq)
        self._leave(seq)
        stats = seq.close_stats()
        self.counters.finished(stats, finish.reason, seq.request.key_label, departure_counted=seq.request.streamed)
        last = seq.take_chunk(final=True)
        assert last is not None
        last.finish_reason, last.error, last.stats, last.scores = finish.reason, finish.error, stats, seq.scores
        self._outbox.append(last)

    def abort(self, request_id: str) -> None:
        """Its caller left: it ends at once (unknown or finished ids are no-ops)."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, Finish(FinishReason.ABORT))

    def abort_all(self, message: str) -> None:
        """The loop failed: every request ends with `message` (its caller hears it from the transport)."""
        for seq in list(self._by_id.values()):
            self.finish(seq, Finish(FinishReason.ERROR, message))
        self._outbox.clear()

    # ---- what the engine's turn takes ------------------------------------------------------------------
    def take_chunks(self) -> list[EngineChunk]:
        chunks = list(self._outbox)
        self._outbox.clear()
        return chunks

    def take_dropped_images(self) -> list[str]:
        """The image embeddings the ranks may drop (their sequences left mid-image)."""
        dropped, self._dropped_images = self._dropped_images, []
        return dropped

    # ---- inside ----------------------------------------------------------------------------------------
    def _wait(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._waiting.append(seq)

    def _resumable(self, seq: Sequence, limit: int) -> tuple[int, int | None]:
        """A hybrid prompt resumes only where a state snapshot exists: the tokens its longest cached block
        prefix with a snapshot covers, and that snapshot's slot (0, None: from the first token)."""
        assert self.states is not None
        hits = self.blocks.match_prefix(seq.token_ids, limit, seq.request.prompt_hashes, seq.request.images)
        for count in range(len(hits), 0, -1):
            slot = self.states.snapshot(self.blocks.blocks[hits[count - 1]].block_hash)
            if slot is not None:
                return count * self.blocks.block_size, slot
        return 0, None

    def _keep(self, seq: Sequence) -> None:
        """A reply that ended well: the next turn resumes here (its states named first: the disk store keeps
        them with the blocks), and its chain goes to disk before its blocks are released."""
        if seq.states is not None and self.states is not None:
            self.states.name_if_due(seq.states, seq.token_ids, True, seq.request.images)
        if self.disk is not None:
            chain = self.blocks.resident_chain(seq.block_table)
            if not self.keep_conversations:  # --learn: only the prefix it shared with earlier requests
                chain = chain[: seq.stats.cached_tokens // self.blocks.block_size]
            self.disk.remember(chain)

    def _leave(self, seq: Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
        if seq in self._waiting:
            self._waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        self._by_id.pop(seq.request_id, None)

    def _free(self, seq: Sequence) -> None:
        """Its blocks, image embeddings and state slots go back."""
        self.blocks.release(seq.block_table)
        if seq.images_on_rank:
            self._dropped_images += release_images(seq)
        if self.states is not None and seq.states is not None:
            self.states.release(seq.states)
            seq.states = None
