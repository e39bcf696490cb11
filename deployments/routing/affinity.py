"""The prefix-affinity routing rule, pure: which Scheduler replica a prompt should go to, and why.

A request goes to the replica holding the longest run of its prompt's leading blocks (matched on the
chained block names, exactly), unless that replica's queue is longer than the least loaded one's by more
than an absolute and a relative margin (SGLang's router balances the same way): then the least loaded one
takes it. A prompt nobody holds enough of goes to the least loaded replica, ties to the one holding the
fewest blocks, so new conversations spread over the replicas. Blocks a replica's node holds on disk (the
prompt-state store) count as a partial match.
"""

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

AFFINITY, BALANCE, NO_MATCH = "affinity", "balance", "no_match"
DISK_WEIGHT = 0.5  # a block its node's disk store holds counts half: read back, not prefilled, but not in RAM
ROUTE_REASONS = (AFFINITY, BALANCE, NO_MATCH)


@dataclass(frozen=True)
class RoutingKnobs:
    """Set from the app's args (`routing_*`)."""

    balance_abs: int = 4  # queue difference (requests) the affinity target may lead the least loaded by
    balance_rel: float = 1.5  # ... and the ratio of their queues it may reach; past both, load wins
    min_match: float = 0.25  # share of the prompt's full blocks a replica must hold to count as a match


@dataclass
class ReplicaView:
    """What the router knows of one replica when it routes a request."""

    replica_id: str
    load: int  # requests in flight there (what this router sent, or what the replica reported if more)
    resident: set[bytes]  # block keys its last digest holds
    routed: int = 0  # requests this router sent there so far
    on_disk: set[bytes] = field(default_factory=set)  # block keys its node's disk store holds (learn on)
    sent: Collection[bytes] = ()  # prompt keys sent there that no report has shown yet (held there by now)

    def in_ram(self, key: bytes) -> bool:
        return key in self.resident or key in self.sent

    @property
    def held(self) -> int:
        return len(self.resident) + len(self.sent)


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    reason: str  # one of ROUTE_REASONS
    matched_blocks: float  # leading prompt blocks the chosen replica holds (disk-held ones count DISK_WEIGHT)


def matched_blocks(keys: list[bytes], holds: Callable[[bytes], bool]) -> int:
    """Leading blocks of the prompt that `holds` (the engine stops its match at the first miss)."""
    count = 0
    for key in keys:
        if not holds(key):
            break
        count += 1
    return count


def match_score(keys: list[bytes], view: ReplicaView) -> float:
    """Leading blocks held in RAM, then DISK_WEIGHT for each further one its node's disk store holds."""
    in_ram = matched_blocks(keys, view.in_ram)
    if not view.on_disk:
        return float(in_ram)
    either = in_ram + matched_blocks(keys[in_ram:], lambda key: view.in_ram(key) or key in view.on_disk)
    return in_ram + DISK_WEIGHT * (either - in_ram)


def overloaded(target: ReplicaView, least: ReplicaView, knobs: RoutingKnobs) -> bool:
    gap = target.load - least.load
    return gap > knobs.balance_abs and target.load > knobs.balance_rel * least.load


def choose_replica(views: list[ReplicaView], keys: list[bytes], knobs: RoutingKnobs) -> RouteDecision:
    """The replica for a prompt whose full blocks have these keys; `views` is never empty."""
    matches = {view.replica_id: match_score(keys, view) for view in views}
    least = min(views, key=lambda v: (v.load, v.held, v.routed, v.replica_id))
    best = max(views, key=lambda v: (matches[v.replica_id], -v.load, -v.routed, v.replica_id))
    matched = matches[best.replica_id]
    if not keys or matched == 0 or matched < knobs.min_match * len(keys):
        return RouteDecision(least.replica_id, NO_MATCH, matches[least.replica_id])
    if best is not least and overloaded(best, least, knobs):
        return RouteDecision(least.replica_id, BALANCE, matches[least.replica_id])
    return RouteDecision(best.replica_id, AFFINITY, matched)
