"""Living weights (`--slide`, docs/slide.md): what Ingress asks the Slide room, and what the room answers.

A learn or a delete is one streaming call (`SlideChange`): its first item is a `Refusal` (alone: the change
never started; `BUSY_CODE` when another change holds the lock) or `ChangeStarted` (every refusal is past and
the lock is held), then the change's events in order. Ingress frames each event as the route's server-sent
event or a part of one JSON body; the events' fields, in order, are the JSON the client reads.

A fact given to learn is validated as it is read (Ingress's body, or the served model's extraction): the
same `FactBody` rules either way.
"""

from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.messages.replies import Refusal
from deployments.messages.slide import SlideFact

MAX_QUESTIONS = 8  # questions one fact may carry
MAX_FIELD_CHARS = 2_000  # a fact, a question, an answer or a delete's reason
BUSY_CODE = "slide_busy"  # a refusal's code while another change holds the lock (the route adds Retry-After)


def filled(value: str) -> str:
    """A text field's rule: not empty, nor only whitespace."""
    if not value.strip():
        raise ValueError("must not be empty or only whitespace")
    return value


Filled = Annotated[str, Field(max_length=MAX_FIELD_CHARS)]


class QuestionBody(BaseModel):
    """A question about a fact and the answer a greedy reply must give (compared stripped)."""

    model_config = ConfigDict(extra="forbid")

    question: Filled
    answer: Filled

    _question = field_validator("question")(filled)
    _answer = field_validator("answer")(filled)


class FactBody(BaseModel):
    """One fact to learn: its text and the questions that check it. Unknown fields are refused: a misspelt
    `answer` would silently change what is learned."""

    model_config = ConfigDict(extra="forbid")

    text: Filled
    questions: list[QuestionBody]

    _text = field_validator("text")(filled)

    @field_validator("questions")
    @classmethod
    def _questions(cls, questions: list[QuestionBody]) -> list[QuestionBody]:
        if not 1 <= len(questions) <= MAX_QUESTIONS:
            raise ValueError(f"a fact needs 1 to {MAX_QUESTIONS} questions, got {len(questions)}")
        return questions


# ---- Ingress to the Slide room: the changes --------------------------------------------------------------


@dataclass(frozen=True)
class LearnFacts:
    """POST /v1/slide/learn with `facts`: learn each in turn."""

    owner: str  # the request id: the lock's owner
    facts: list[FactBody]


@dataclass(frozen=True)
class LearnText:
    """POST /v1/slide/learn with `text`: the served model extracts its facts, then each is learned."""

    owner: str
    text: str
    key_label: str = "none"  # the API key's label: the extraction request is counted under it


@dataclass(frozen=True)
class ForgetFact:
    """DELETE /v1/slide/fact/{id}: zero the fact's neurons and check every other fact."""

    owner: str
    fact_id: int
    reason: str | None = None  # kept in the graph as the fact's `reason`


SlideChange = LearnFacts | LearnText | ForgetFact


@dataclass(frozen=True)
class ChangeStarted:
    """The change passed every refusal and holds the lock: its events follow."""


# ---- the Slide room to Ingress: the events -------------------------------------------------------------
# Each event's `name` is its SSE name and its JSON `type`; a field defaulting to None is left out while None.


@dataclass(frozen=True)
class FactEvent:
    """The fact as the graph holds it (a learn's: `learning`, its neurons; a delete's: as it was)."""

    name: ClassVar[str] = "fact"
    fact: SlideFact


@dataclass(frozen=True)
class LearningEvent:
    """One training slice: the latest step, its loss, and the answer rows a greedy reply already gets right."""

    name: ClassVar[str] = "learning"
    id: int
    step: int
    loss: float
    right: int
    rows: int


@dataclass(frozen=True)
class CheckFigures:
    """A staged version's checks: its own questions, every other learned fact, the locality set."""

    questions: int
    answered: int
    facts: int
    facts_kept: int
    locality: int
    locality_kept: int


@dataclass(frozen=True)
class LearnedEvent:
    """The fact's version passed its checks and is current on every replica."""

    name: ClassVar[str] = "learned"
    id: int
    version: int
    saved: bool  # every replica wrote its shards and graph file
    checked: CheckFigures
    steps: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FailedEvent:
    """A fact not learned, and why: `id` None when it never reached the graph (the pocket was full, or a text
    gave no facts); after failed checks, the dropped `version` and what the checks found."""

    name: ClassVar[str] = "failed"
    id: int | None
    text: str | None = None  # the fact's text, when the pocket had no room for it
    reason: str
    version: int | None = None
    checked: CheckFigures | None = None


@dataclass(frozen=True)
class CheckingEvent:
    """A delete marked the fact `deleting` and will check `facts` learned facts afterwards."""

    name: ClassVar[str] = "checking"
    id: int
    state: str
    facts: int


@dataclass(frozen=True)
class ZeroedEvent:
    """The fact's neurons are zero in `version`, now current on every replica."""

    name: ClassVar[str] = "zeroed"
    id: int
    version: int
    neurons: list[int]
    saved: bool


@dataclass(frozen=True)
class CheckedEvent:
    """Every other learned fact asked again at the zeroed version: `kept` still answer; `changed` do not."""

    name: ClassVar[str] = "checked"
    id: int
    version: int
    facts: int
    kept: int
    changed: list[int]


@dataclass(frozen=True)
class ForgotEvent:
    """The delete's end: `deleted` only when saved and the graph file says so."""

    name: ClassVar[str] = "forgot"
    id: int
    deleted: bool
    state: str
    version: int


@dataclass(frozen=True)
class ErrorEvent:
    """A change that failed after its first event (no internal text: GET /v1/slide/graph shows each fact)."""

    name: ClassVar[str] = "error"
    message: str


SlideEvent = (
    FactEvent
    | LearningEvent
    | LearnedEvent
    | FailedEvent
    | CheckingEvent
    | ZeroedEvent
    | CheckedEvent
    | ForgotEvent
    | ErrorEvent
)
SlideItem = Refusal | ChangeStarted | SlideEvent  # what a change's stream carries
