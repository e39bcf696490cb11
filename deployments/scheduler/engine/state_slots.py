"""Hybrid models' state slots: where each running sequence's recurrent states live, and the prefix cache
for states (docs/engine.md, Hybrid models).

A recurrent layer cannot resume a prefix from its KV rows: it needs the state after that prefix. So every
running sequence holds a running slot (its states, advanced by each step) and a rolling slot (the states
at the latest block boundary it crossed, captured during the step that crossed it). At the end of its
prompt pass and at the end of its reply, the rolling slot joins the cache named by the chained block hash
of the tokens it covers (the same names the KV blocks have), so a later prompt sharing that prefix resumes
there: a copy into its running slot, then only the rest is computed. Inside a long prompt pass, a step also
captures the states at every multiple of `state_snapshot_tokens` it passes into slots of their own, named
the same way after the step. Cached snapshots are evicted least recently used first, as blocks are.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from deployments.messages.images import ImageInput
from deployments.messages.prefix import PromptHashes
from deployments.messages.step import ZERO_STATE


@dataclass
class SeqStates:
    """One running sequence's slots (held on its Sequence; set by the planner at admission)."""

    running: int  # its states after its computed tokens
    rolling: int | None = None  # its states at `rolling_tokens` (None: no slot was free)
    rolling_tokens: int = 0  # the block boundary `rolling` holds (0: nothing captured yet)
    named_tokens: int = 0  # the latest boundary handed to the cache
    restore_from: int | None = ZERO_STATE  # a copy into `running` due before its next step
    # Verify rounds: the slot holding the states after each row but the last (row offset -> slot).
    row_slots: dict[int, int] = field(default_factory=dict)
    # Snapshots captured inside a long prompt pass by the last step, not yet named: (tokens covered, slot).
    interval_slots: list[tuple[int, int]] = field(default_factory=list)


class StateSlots:
    """Slot bookkeeping: free slots, running sequences' slots, and snapshots named by block hash."""

    def __init__(self, num_slots: int, block_size: int, max_snapshots: int, snapshot_tokens: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self.max_snapshots = max_snapshots  # 0: no state is kept across requests
        self.snapshot_tokens = snapshot_tokens  # inside a long prompt, a snapshot at least this often
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: low slots first
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # name -> slot, least recently used first
        self.pinned: set[int] = set()  # snapshots a planned step copies from: not evicted until it ran

    @property
    def num_used(self) -> int:
        """Slots held by running sequences (what /health's state usage reports)."""
        return self.num_slots - len(self.free) - len(self.snapshots)

    def take(self) -> int | None:
        """A slot: a free one, else the least recently used snapshot's (None: every slot is in use)."""
        if self.free:
            return self.free.pop()
        for name, slot in self.snapshots.items():
            if slot not in self.pinned:
                del self.snapshots[name]
                return slot
        return None

    def give_back(self, slot: int | None) -> None:
        if slot is not None:
            self.free.append(slot)

    # ---- the prefix cache -----------------------------------------------------------------------------
    def snapshot(self, name: bytes | None) -> int | None:
        """The slot holding the states after the prefix named `name`, now most recently used; None: none."""
        if name is None:
            return None
        slot = self.snapshots.get(name)
        if slot is not None:
            self.snapshots.move_to_end(name)
        return slot

    def start(self, restore: int | None) -> SeqStates:
        """Slots for a sequence starting from nothing (`restore` None) or from a cached snapshot's slot."""
        if restore is not None:
            self.pinned.add(restore)
        running = self.take()
        assert running is not None, "the pool holds two slots per lane, so a running slot is always free"
        return SeqStates(running, self.take(), restore_from=ZERO_STATE if restore is None else restore)

    def name(self, states: SeqStates, name: bytes) -> None:
        """Hand the rolling slot to the cache under `name` (its tokens' chained block hash)."""
        states.named_tokens = states.rolling_tokens
        if self.max_snapshots == 0 or states.rolling is None:
            return
        if name in self.snapshots:
            self.snapshots.move_to_end(name)
            return
        self.keep(name, states.rolling)
        states.rolling = self.take()

    def interval_points(self, start: int, end: int, named: int) -> list[int]:
        """The multiples of `snapshot_tokens` a step covering tokens (start, end) passes, past `named`: where
        a long prompt pass captures snapshots besides its rolling slot's boundary (`end`)."""
        every = max(self.block_size, self.snapshot_tokens // self.block_size * self.block_size)  # whole blocks
        first = (max(start, named) // every + 1) * every
        return list(range(first, end, every)) if self.max_snapshots else []

    def keep(self, name: bytes, slot: int) -> None:
        """Cache `slot` (captured, or read back from disk) under `name`, most recently used, within
        `max_snapshots`; a name already cached keeps its slot and this one goes free."""
        if name in self.snapshots or self.max_snapshots == 0:
            if name in self.snapshots:
                self.snapshots.move_to_end(name)
            self.free.append(slot)
            return
        self.snapshots[name] = slot
        while len(self.snapshots) > self.max_snapshots:
            _, evicted = self.snapshots.popitem(last=False)
            self.free.append(evicted)

    def name_if_due(
        self, states: SeqStates, token_ids: list[int], now: bool, images: Sequence[ImageInput] = ()
    ) -> None:
        """Name the last step's interval snapshots, then hand the rolling slot to the cache when it holds a
        boundary not yet named and `now` (a prompt pass or a reply ended) or `snapshot_tokens` have passed
        since the last one."""
        for tokens, slot in states.interval_slots:
            self.keep(PromptHashes.of(token_ids[:tokens], self.block_size, images).hashes[-1], slot)
            states.named_tokens = max(states.named_tokens, tokens)
        states.interval_slots.clear()
        new = states.rolling_tokens - states.named_tokens
        if new > 0 and (now or new >= self.snapshot_tokens):
            prefix = token_ids[: states.rolling_tokens]
            self.name(states, PromptHashes.of(prefix, self.block_size, images).hashes[-1])

    def release(self, states: SeqStates) -> None:
        """A sequence ended or was preempted: its slots go free (a named snapshot stays cached)."""
        for slot in (states.running, states.rolling, *states.row_slots.values()):
            self.give_back(slot)
        for _, slot in states.interval_slots:  # captured, but the sequence ended before they were named
            self.give_back(slot)
        states.row_slots.clear()
        states.interval_slots.clear()

    def step_ran(self) -> None:
        """The planned step's copies are done: snapshots it read may be evicted again."""
        self.pinned.clear()
