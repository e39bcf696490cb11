"""The Scheduler deployment's request router (Serve's request-router API): prefix affinity with balance.

It runs inside each caller's process (the Ingress replicas), so it costs no Ray call per request. Each
replica reports the keys of the blocks it holds through Serve's routing stats (`record_routing_stats`,
every `routing_stats_period_s`); between two reports the router also remembers which prompts it sent
where, so a conversation's next turn finds its replica before the next report. The request's block names
are computed here once and sent in the request's routed copy (`EngineRequest.routed`: the request itself is
immutable), and the engine's prefix match reuses them.

A request counts in flight at the replica chosen for it from that choice until Serve reports it completed,
or until it leaves before it was sent (cancelled while it waited for a replica): docs/routing.md.
"""

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.messages.prefix import PrefixDigest, PromptHashes
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.routing.affinity import ReplicaView, RoutingKnobs, choose_replica

log = logging.getLogger("tensorfold.router")
ROUTED_KEYS_CAP = 200_000  # keys remembered per replica between its reports (~a few MB at most)
ROUTED_KEYS_TTL_PERIODS = 30  # a sent prompt no report has shown yet is remembered this many periods


def routing_stats(digest: PrefixDigest, load: int) -> dict[str, object]:
    """What a Scheduler replica reports: plain values, since Serve's controller relays them unimported."""
    return {
        "block_size": digest.block_size,
        "keys": digest.keys,
        "disk_keys": digest.disk_keys,
        "version": digest.version,
        "load": load,
    }


@dataclass
class _ReplicaMemory:
    """This router's picture of one replica."""

    version: int = -1  # of the digest parsed last
    reported: set[bytes] = field(default_factory=set)
    reported_disk: set[bytes] = field(default_factory=set)  # what its node's disk store holds
    reported_load: int = 0
    reported_at: float = 0.0  # when that digest was parsed here
    routed_keys: dict[bytes, float] = field(default_factory=dict)  # prompt keys sent there -> when
    in_flight: int = 0  # the _Choice objects that name it
    routed: int = 0


@dataclass(eq=False)  # compared by identity: two attempts at one replica are two counts
class _Choice:
    """One routing attempt of a request, counted in flight at `replica_id` (a retry is another attempt)."""

    replica_id: str
    sent: bool = False  # Serve's choice returned: it sends the request and reports it completed once


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(
        self,
        block_size: int = 16,
        balance_abs: int = 4,
        balance_rel: float = 1.5,
        min_match: float = 0.25,
        stats_period_s: float = 1.0,
        **_: object,
    ) -> None:
        self._block_size = block_size  # the engines' (from the same args), so names match before any report
        self._knobs = RoutingKnobs(balance_abs=balance_abs, balance_rel=balance_rel, min_match=min_match)
        self._stats_period_s = stats_period_s
        self._memory: dict[str, _ReplicaMemory] = {}
        self._choosing: dict[asyncio.Future, _Choice] = {}  # an attempt's future -> its choice, until it settles
        self._choices: dict[str, list[_Choice]] = {}  # internal request id -> its counted attempts

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every replica is a candidate here: Serve then sleeps between retries when the choice is busy or
            # its queue cannot be read. Without it, Serve retries at once, and the spinning starves the very
            # event loop that reads the queues (a livelock under load).
            pending_request.routing_context.should_backoff = True
        request = _engine_request(pending_request)
        if request is None or not candidate_replicas:  # not a generation call: any replica will do
            return [candidate_replicas]
        now = time.monotonic()
        views = [self._view(replica, now) for replica in candidate_replicas]
        hashes = self._prompt_hashes(request)
        keys = hashes.keys()
        decision = choose_replica(views, keys, self._knobs)
        assert pending_request is not None  # `_engine_request` found the request in its arguments
        routed = request.routed(hashes, decision.reason)
        pending_request.args = [routed, *pending_request.args[1:]]  # what the chosen replica receives
        chosen = next(r for r in candidate_replicas if r.replica_id.unique_id == decision.replica_id)
        self._record(pending_request, decision.replica_id, keys, now)
        return [[chosen]]

    async def _choose_replica_for_request(
        self, pending_request: PendingRequest, *, is_retry: bool = False
    ) -> RunningReplica:
        """Serve's wait for a replica (one attempt). Returned, the request is sent without another await and
        completes once (`on_request_completed`); raised (the caller cancelled while it waited, even after the
        choice was made), it was never sent, and nothing else would take its count back."""
        try:
            replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        except BaseException:
            choice = self._choosing.pop(pending_request.future, None)
            if choice is not None:
                self._release(pending_request.metadata.internal_request_id, choice)
            raise
        choice = self._choosing.pop(pending_request.future, None)
        if choice is not None:
            self._move(choice, replica.replica_id.unique_id)  # the replica Serve picked from those offered
            choice.sent = True
        return replica

    def on_request_completed(self, replica_id: object, internal_request_id: str) -> None:
        """Serve's word that one sent attempt ended (replied, failed, rejected or cancelled)."""
        sent = [c for c in self._choices.get(internal_request_id, ()) if c.sent]
        unique_id = getattr(replica_id, "unique_id", None)
        choice = next((c for c in sent if c.replica_id == unique_id), sent[0] if sent else None)
        if choice is not None:
            self._release(internal_request_id, choice)

    def in_flight(self) -> dict[str, int]:
        """The requests counted in flight, by replica id (what the balance rule reads)."""
        return {replica: memory.in_flight for replica, memory in self._memory.items()}

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for gone in set(self._memory) - live:  # a restarted replica comes back empty, under a new id
            del self._memory[gone]

    # ---- state ----------------------------------------------------------------------------------------
    def _view(self, replica: RunningReplica, now: float) -> ReplicaView:
        memory = self._memory.setdefault(replica.replica_id.unique_id, _ReplicaMemory())
        stats = replica.routing_stats or {}
        fresh = stats.get("version", -1) != memory.version and stats.get("block_size") == self._block_size
        if fresh and isinstance(stats.get("keys"), bytes):
            digest = PrefixDigest(
                int(stats["block_size"]), stats["keys"], int(stats["version"]), bytes(stats.get("disk_keys", b""))
            )
            memory.version, memory.reported, memory.reported_at = digest.version, digest.key_set(), now
            memory.reported_disk = digest.disk_key_set()
            # A report can lag behind what was sent (it is relayed by Serve's controller): a prompt sent there is
            # forgotten once a report holds it, or after ROUTED_KEYS_TTL_PERIODS reports' time at most.
            horizon = now - ROUTED_KEYS_TTL_PERIODS * self._stats_period_s
            memory.routed_keys = {
                k: t for k, t in memory.routed_keys.items() if t >= horizon and k not in memory.reported
            }
        memory.reported_load = int(stats.get("load", 0))
        load = max(memory.in_flight, memory.reported_load)
        return ReplicaView(
            replica.replica_id.unique_id,
            load,
            memory.reported,
            memory.routed,
            memory.reported_disk,
            memory.routed_keys.keys(),
        )

    def _prompt_hashes(self, request: EngineRequest | ImprintQuery) -> PromptHashes:
        """The request's block names (computed once: a retry gets the routed copy, which carries them)."""
        if request.prompt_hashes is None or request.prompt_hashes.block_size != self._block_size:
            return PromptHashes.of(request.prompt_token_ids, self._block_size, request.images)
        return request.prompt_hashes

    def _record(self, pending: PendingRequest | None, replica_id: str, keys: list[bytes], now: float) -> None:
        memory = self._memory[replica_id]
        if pending is not None:
            self._count(pending, replica_id)
        for key in keys:
            memory.routed_keys.pop(key, None)  # re-inserted: the dict's order stays oldest first
            memory.routed_keys[key] = now
        if len(memory.routed_keys) > ROUTED_KEYS_CAP:  # oldest first out (dicts keep insertion order)
            for key in list(memory.routed_keys)[: len(memory.routed_keys) - ROUTED_KEYS_CAP]:
                del memory.routed_keys[key]

    def _count(self, pending: PendingRequest, replica_id: str) -> None:
        """This attempt in flight at `replica_id`: counted at its first choice, moved if a later one differs."""
        choice = self._choosing.get(pending.future)
        if choice is None:
            choice = self._choosing[pending.future] = _Choice(replica_id)
            self._choices.setdefault(pending.metadata.internal_request_id, []).append(choice)
            self._add(replica_id, 1)
        self._move(choice, replica_id)

    def _move(self, choice: _Choice, replica_id: str) -> None:
        if choice.replica_id != replica_id:
            self._add(choice.replica_id, -1)
            choice.replica_id = replica_id
            self._add(replica_id, 1)

    def _release(self, internal_request_id: str, choice: _Choice) -> None:
        choices = self._choices.get(internal_request_id, [])
        if choice in choices:
            choices.remove(choice)
            self._add(choice.replica_id, -1)
        if not choices:
            self._choices.pop(internal_request_id, None)

    def _add(self, replica_id: str, count: int) -> None:
        """In flight and routed (counted per choice) at a replica this router still knows."""
        memory = self._memory.get(replica_id)
        if memory is not None:
            memory.in_flight += count
            memory.routed += max(count, 0)


def _engine_request(pending: PendingRequest | None) -> EngineRequest | ImprintQuery | None:
    """A generation request, or an imprint query (it asks about the replica its conversation would go to)."""
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, (EngineRequest, ImprintQuery)) else None
