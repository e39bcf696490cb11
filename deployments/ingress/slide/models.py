"""The /v1/slide bodies, validated to 400s whose `param` names the client's field (docs/slide.md, Bodies).

A learn body gives either `text` (the served model extracts its facts) or `facts` (each with its questions
and expected answers, deployments/messages/slide_changes.py's `FactBody`), never both. Unknown top-level
fields are ignored as on the other routes; unknown fact or question fields are refused, since a misspelt
`answer` would silently change what is learned.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.sampling_fields import bool_field
from deployments.messages.slide_changes import MAX_FIELD_CHARS, FactBody, filled

MAX_FACTS = 64  # facts one body may give: each is a training run and a round of checks
MAX_TEXT_CHARS = 20_000  # a learn text (its extraction prompt must also fit the window)
MAX_ID_DIGITS = 18  # fact ids count up from 1; any id of 18 digits or fewer fits a signed 64-bit integer


class LearnRequest(BaseModel):
    """POST /v1/slide/learn: `text` or `facts`; `stream` false answers one JSON body with every event."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text: Annotated[str | None, Field(max_length=MAX_TEXT_CHARS)] = None
    facts: list[FactBody] | None = None
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None

    @field_validator("text")
    @classmethod
    def _text(cls, text: str | None) -> str | None:
        return None if text is None else filled(text)

    @field_validator("facts")
    @classmethod
    def _facts(cls, facts: list[FactBody] | None) -> list[FactBody] | None:
        if facts is not None and not 1 <= len(facts) <= MAX_FACTS:
            raise ValueError(f"facts must hold 1 to {MAX_FACTS} facts, got {len(facts)}")
        return facts

    @model_validator(mode="after")
    def _one_source(self) -> "LearnRequest":
        if (self.text is None) == (self.facts is None):
            raise ValueError("give either text (its facts are extracted) or facts, not both or neither")
        return self

    @property
    def streamed(self) -> bool:
        return self.stream is not False


class ForgetRequest(BaseModel):
    """DELETE /v1/slide/fact/{id}'s optional body: the reason the graph keeps, and `stream`."""

    model_config = ConfigDict(extra="allow")

    reason: Annotated[str | None, Field(max_length=MAX_FIELD_CHARS)] = None
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None

    @property
    def streamed(self) -> bool:
        return self.stream is not False


def _param(loc: tuple[int | str, ...]) -> str:
    """`facts[1].questions[0].answer` from pydantic's ('facts', 1, 'questions', 0, 'answer')."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _first_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    loc = tuple(first.get("loc", ()))
    param = _param(loc)
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if not param:  # the whole-body rule (text or facts)
        param = "text"
    return bad_request(f"{param}: {message}", param)


def parse_learn(body: dict[str, Any]) -> LearnRequest:
    """The validated learn body, or the first problem as a 400 naming the field."""
    try:
        return LearnRequest.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None


def parse_forget(body: dict[str, Any]) -> ForgetRequest:
    try:
        return ForgetRequest.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None


def fact_id(raw: str) -> int:
    """A path's fact id: a positive whole number of at most MAX_ID_DIGITS digits, read without `int` first
    (it raises past 4,300 digits); a 400 naming `id` otherwise."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > MAX_ID_DIGITS or int(raw) < 1:
        why = f"the fact id must be a positive whole number of at most {MAX_ID_DIGITS} digits, got {raw[:40]!r}"
        raise bad_request(f"id: {why}", "id", "invalid_fact_id")
    return int(raw)
