"""Living weights (`--slide`, docs/slide.md): what the Slide room and the Scheduler say to each other about the
pocket.

The pocket is a set of extra neurons beside the last decoder layer's MLP, `capacity x neurons_per_fact` in
all; each fact owns `neurons_per_fact` of them. A pocket version is the whole pocket's weights at one moment:
every reply is computed with one version (the one current when it was admitted, or the one its request
names), and every Scheduler replica and tensor-parallel rank holds the same versions.

The Slide room runs a learn or a delete as a series of typed engine calls (`SlideCall`), each sent to every
Scheduler replica, or to the one `replica` named (training runs on one copy; its result is staged on all of
them); the engine makes `PocketCall`s on every tensor-parallel rank.
"""

from dataclasses import dataclass, field

import numpy as np

from deployments.messages.calls import Call, Reply
from deployments.messages.engine_process import EngineCall

# A fact's states in the graph. `learning` and `deleting` are transient: a fact left `deleting` (a crash
# between the weights and the graph) is settled by sending its delete again.
FACT_STATES = ("learning", "learned", "failed", "deleting", "deleted")


@dataclass
class SlideQuestion:
    """A question about a fact and the answer a greedy reply must give (the reply's content, stripped)."""

    question: str
    answer: str


@dataclass
class SlideFact:
    """One fact in the graph (the graph file holds a list of them; GET /v1/slide/graph shows them)."""

    id: int  # 1, 2, ... in the order facts were added; never reused
    text: str
    questions: list[SlideQuestion]
    state: str = "learning"  # one of FACT_STATES
    neurons: list[int] = field(default_factory=list)  # the pocket neurons it owns (held while learned)
    version: int = 0  # the pocket version that learned it (or zeroed it)
    reason: str | None = None  # why it failed, or why it was deleted (the delete's optional reason)
    created: float = 0.0  # wall clock when it was added
    updated: float = 0.0  # wall clock of its last state change


@dataclass
class PocketFigures:
    """The pocket's shape and use (the graph's `pocket` object)."""

    layer: int  # the decoder layer whose MLP the pocket sits beside (the last)
    hidden_size: int
    neurons_per_fact: int
    capacity: int  # facts the pocket holds at most
    neurons_used: int  # neurons owned by facts that are learning, learned or deleting
    version: int  # the current version (0: the base model, nothing learned since the pocket was made)
    nonzero_neurons: int  # neurons of the current version whose weights are not all zero


@dataclass
class SlideGraph:
    """One replica's graph: every fact and the pocket (the same on every replica)."""

    model: str  # the checkpoint's identity (docs/slide.md, Files)
    pocket: PocketFigures
    facts: list[SlideFact]
    # Facts the pocket can still take: its free neurons (held by no fact in the graph, and zero in the current
    # version: a cleared graph's neurons keep what they learned) per fact, as adding a fact allocates them.
    room: int
    busy: str = ""  # the learn or delete running now ("" when none)


@dataclass
class PocketPatch:
    """Some neurons' new weights: a version is its base version with these rows replaced.

    float32 rows; a deleted fact's patch is all zeros (its neurons then contribute exactly nothing).
    """

    version: int  # the version this patch makes
    base: int  # the version it starts from
    neurons: list[int]  # [n] pocket neuron indices
    gate: np.ndarray  # [n, H] each neuron's key: it fires where relu(gate . x + bias) > 0
    bias: np.ndarray  # [n]
    down: np.ndarray  # [n, H] what each neuron adds to the layer's output, times its activation


@dataclass
class SlideExample:
    """A question as the model sees it: the rendered chat prompt and the answer's ids (ending with the end
    token, so a greedy reply stops there)."""

    prompt_ids: list[int]
    answer_ids: list[int]


@dataclass
class TrainJob:
    """Teach one fact's neurons: every example's answer under greedy decoding, and silence elsewhere."""

    fact_id: int
    neurons: list[int]
    examples: list[SlideExample]
    # Token sequences on which these neurons must not fire at any position: the locality set's prompts with
    # the replies they get now, and the other facts' questions with the replies the base model gives them
    # (so that a deleted fact's question answers as before it was learned).
    quiet: list[list[int]]
    max_steps: int
    margin: float  # pre-activations at least this far on the right side of zero
    learning_rate: float
    # The other learned facts' questions and answers: still answered afterwards (these neurons may fire there
    # only where the answer stays right).
    kept: list[SlideExample] = field(default_factory=list)


@dataclass
class TrainProgress:
    """What training did since the last call (the `learning` events), and its result once it ended."""

    steps: list[tuple[int, float, int]] = field(default_factory=list)  # (step, loss, answer rows right)
    answer_rows: int = 0  # rows the examples' answers span (all right: greedy replies give every answer)
    done: bool = False
    patch: PocketPatch | None = None  # set when done and the neurons fit
    failed: str = ""  # why training ended without a fit


@dataclass
class TrainReport:
    """What some training steps did on a rank (the same on every rank)."""

    steps: list[tuple[int, float, int]]  # (step, loss, answer rows right)
    finished: bool  # fitted, or out of steps
    fitted: bool
    answer_rows: int
    right: int  # answer rows right at the latest judgement
    silent: bool  # no quiet row fired at the latest judgement


# ---- the Slide room to every Scheduler replica: the engine calls of a learn or a delete ------------------------


@dataclass(frozen=True)
class SlideCall(EngineCall[Reply]):
    """One engine call of a learn or delete, sent to every Scheduler replica, or only to `replica` (the
    others answer None); answered by the engine's SlideKeeper."""

    replica: str = field(default="", kw_only=True)  # "": every replica


@dataclass(frozen=True)
class ReadGraph(SlideCall[SlideGraph]):
    """The replica's graph."""


@dataclass(frozen=True)
class BeginChange(SlideCall[str]):
    """Take (or renew) the lock for `owner`: "" when held, else what holds it."""

    owner: str
    what: str


@dataclass(frozen=True)
class EndChange(SlideCall[None]):
    """Let the lock go (when `owner` holds it), stopping its training."""

    owner: str


@dataclass(frozen=True)
class AddFact(SlideCall[SlideFact | str]):
    """Add a fact to the graph, `learning`: the fact, or why not (the pocket is full)."""

    text: str
    questions: list[SlideQuestion]


@dataclass(frozen=True)
class TrainFact(SlideCall[TrainProgress]):
    """Start training the job's fact (the first call for it), or report its progress since the last call."""

    job: TrainJob


@dataclass(frozen=True)
class StageVersion(SlideCall[int]):
    """Put a version on the ranks: its number."""

    patch: PocketPatch


@dataclass(frozen=True)
class CommitVersion(SlideCall[bool]):
    """Make a staged version current and set the fact's state: True once the files hold it."""

    version: int
    fact_id: int
    state: str  # one of FACT_STATES
    reason: str | None = None


@dataclass(frozen=True)
class DropVersion(SlideCall[None]):
    """Forget a staged version that will not be committed."""

    version: int


@dataclass(frozen=True)
class SetFactState(SlideCall[SlideFact | None]):
    """Set a fact's state at the current version: the fact, or None when there is no such fact."""

    fact_id: int
    state: str  # one of FACT_STATES
    reason: str | None = None


@dataclass(frozen=True)
class ZeroFact(SlideCall[PocketPatch]):
    """The patch zeroing a fact's neurons, as the next version from the current one."""

    fact_id: int


@dataclass(frozen=True)
class ClearGraph(SlideCall[int]):
    """Drop every fact from the graph: how many there were."""


# ---- the engine to each tensor-parallel rank: the pocket's operations (model_rank/pocket_ops.py) --------


class PocketCall(Call[Reply]):
    """A living-weights operation made on every rank alike (rank 0's answer is kept)."""


@dataclass(frozen=True)
class StagePocket(PocketCall[None]):
    """Put a version on the rank."""

    patch: PocketPatch


@dataclass(frozen=True)
class KeepVersions(PocketCall[None]):
    """Every version but these leaves the rank."""

    versions: list[int]


@dataclass(frozen=True)
class StartTraining(PocketCall[int]):
    """Start fitting the job's neurons on the rows captured for it: the answer rows."""

    job: TrainJob
    base: int
    version: int


@dataclass(frozen=True)
class TrainSteps(PocketCall[TrainReport]):
    """Train up to `count` steps: what they did."""

    count: int


@dataclass(frozen=True)
class TakePatch(PocketCall[PocketPatch]):
    """The fitted neurons as a patch (training ends)."""


@dataclass(frozen=True)
class StopTraining(PocketCall[None]):
    """Drop the fact being trained, if any."""


@dataclass(frozen=True)
class DropCaptures(PocketCall[None]):
    """Drop the rows captured under these keys."""

    keys: list[str]
