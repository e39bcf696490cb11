"""What a Scheduler replica and its engine exchange, on a thread (EngineLoop) or over the engine process's
socket (EngineProcess and its child), declared once.

  replica -> engine: the EngineConfig (a child only), then an `Inbox` per wake-up (its requests, aborts and
                     typed `EngineCall`s); `StoreReply` to a relayed store call; `Stop`
  engine -> replica: `Ready` or `StartFailed` (a child only), then one `Stepped` per turn of the engine's
                     loop (`Engine.run_once`); `RelayedStoreCall` for the node's prompt store (a child only)

Every class is importable by module name, so plain pickle carries them; nothing here imports torch.
"""

from dataclasses import dataclass, field
from typing import Any

from deployments.messages.calls import Call, Reply
from deployments.messages.memory import ReplicaMemory
from deployments.messages.prefix import PrefixDigest
from deployments.messages.replies import EngineChunk, ImprintAnswer, Refusal
from deployments.messages.requests import EngineRequest, ImprintQuery
from deployments.messages.status import EngineInfo
from deployments.messages.store import StoreCall, StoreUnavailable

NO_REPLY = -1  # a RelayedStoreCall nobody waits for (a write)


class EngineCall(Call[Reply]):
    """A call a replica makes on its engine, answered between two steps (`Engine.answer`)."""


@dataclass(frozen=True)
class Imprint(EngineCall[ImprintAnswer]):
    """The imprint routes' question about a rendered conversation (docs/store.md)."""

    query: ImprintQuery


@dataclass(frozen=True)
class ForgetDisk(EngineCall[int | StoreUnavailable]):
    """DELETE /v1/imprint: the bytes freed on the engine's node, or why its store did not delete."""


@dataclass(frozen=True)
class MemorySnapshot(EngineCall[ReplicaMemory]):
    """GET /memory's snapshot of the engine (`reset_peak`: start a new peak after reading it)."""

    reset_peak: bool = False


@dataclass(frozen=True)
class ClientLeft(EngineCall[None]):
    """A client left its streamed reply before all of it went out: counted with the disconnections."""


@dataclass
class CallEnvelope:
    """An engine call on its way, numbered so that its CallAnswer finds the caller."""

    call_id: int  # picked by the caller; its CallAnswer carries it back
    call: EngineCall[Any]  # the engine's own calls, or a living-weights SlideCall (messages/slide.py)


@dataclass
class CallAnswer:
    call_id: int
    value: object  # what the call returned, checked against its reply type (None when it failed)
    error: str | None = None  # "Type: message" when it raised; the caller raises it as a RuntimeError


@dataclass
class Inbox:
    """What arrived for the engine since its last turn (merged in arrival order)."""

    adds: list[EngineRequest] = field(default_factory=list)  # new requests, admitted in order
    aborts: list[str] = field(default_factory=list)  # request ids whose callers left
    calls: list[CallEnvelope] = field(default_factory=list)  # answered before the adds

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.calls)

    def extend(self, later: "Inbox") -> None:
        self.adds.extend(later.adds)
        self.aborts.extend(later.aborts)
        self.calls.extend(later.calls)


@dataclass
class Stepped:
    """Everything one turn of the engine's loop produced (`Engine.run_once`)."""

    chunks: list[EngineChunk] = field(default_factory=list)  # at most one per request (its last one included)
    refusals: list[tuple[str, Refusal]] = field(default_factory=list)  # (request id, why): never admitted
    answers: list[CallAnswer] = field(default_factory=list)  # one per call of the turn's inbox
    failed: str | None = None  # the turn raised: every request in flight ended with this error
    # Sent after a step that finished a request, always once idle, else at most every INFO_INTERVAL_S
    # (deployments/scheduler/engine/snapshots.py); None otherwise.
    info: EngineInfo | None = None
    memory_figures: dict[str, int] = field(default_factory=dict)  # the engine process's device memory, with info
    digest: PrefixDigest | None = None  # the resident blocks' keys for the router, when they changed
    step_kind: str | None = None  # what the step ran: "prefill" or "decode"; None when no step ran
    step_seconds: float = 0.0  # the step's wall time: planning, the forward pass, writing replies


@dataclass
class Ready:
    info: EngineInfo  # the engine's first snapshot, once its model is loaded
    memory_figures: dict[str, int]  # the engine process's device memory and footprint then


@dataclass
class StartFailed:
    message: str  # "Type: message" of what stopped the engine from starting


@dataclass
class Stop:
    """A planned stop: the engine writes what is waiting for disk, then exits."""


@dataclass
class RelayedStoreCall:
    """A call the child's engine makes on the node's prompt store, relayed by the replica."""

    call_id: int  # NO_REPLY for writes
    call: StoreCall[Any]


@dataclass
class StoreReply:
    call_id: int
    value: object
    error: str | None = None  # "Type: message" when the store raised
