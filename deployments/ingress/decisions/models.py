"""The decision request body, validated to 400s whose `param` names the client's field.

Shapes follow SGLang's decision API where docs/api.md is silent: a question is {id, type, question} plus
`options` (choice: [{name, description?}]), `levels` (score: [text]) or `yes` / `no` (yes_no: optional
descriptions). Unknown top-level fields are ignored as on the other routes; unknown question fields are
refused, since a misspelt `options` or `levels` would silently change the question asked.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from deployments.ingress.http.errors import APIError, bad_request
from deployments.ingress.sampling_fields import bool_field, float_field

PROMPT_FORMAT_VERSION = 1
MAX_OPTIONS = 26  # choice labels A..Z
MAX_LEVELS = 10  # score labels 0..9
MAX_QUESTIONS = 128  # each question is one prompt pass: bounds the work one body can ask for
QUESTION_TYPES = ("choice", "score", "yes_no")

Text = Annotated[str, Field(min_length=1)]


class ChoiceOption(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    description: str | None = None


class _Question(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Text
    question: Text


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    options: list[ChoiceOption]

    @field_validator("options")
    @classmethod
    def _options(cls, options: list[ChoiceOption]) -> list[ChoiceOption]:
        if not 2 <= len(options) <= MAX_OPTIONS:
            raise ValueError(f"a choice question needs 2 to {MAX_OPTIONS} options, got {len(options)}")
        names = [o.name for o in options]
        duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if duplicate is not None:
            raise ValueError(f"option names must be distinct; {duplicate!r} appears twice")
        return options


class ScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[Text]

    @field_validator("levels")
    @classmethod
    def _levels(cls, levels: list[str]) -> list[str]:
        if not 2 <= len(levels) <= MAX_LEVELS:
            raise ValueError(f"a score question needs 2 to {MAX_LEVELS} levels, got {len(levels)}")
        return levels


class YesNoQuestion(_Question):
    type: Literal["yes_no"]
    yes: str | None = None  # what a yes means, shown as its own line when given
    no: str | None = None


Question = Annotated[ChoiceQuestion | ScoreQuestion | YesNoQuestion, Field(discriminator="type")]


def _template_kwargs(value: Any) -> dict[str, Any] | None:
    """Only thinking off can be said: the answer label must be the reply's first token."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs must be an object or null")
    other = sorted(set(value) - {"enable_thinking"})
    if other:
        raise ValueError(f"chat_template_kwargs may only hold enable_thinking: false, got the key {other[0]!r}")
    if "enable_thinking" in value and value["enable_thinking"] is not False:
        raise ValueError("chat_template_kwargs.enable_thinking must be false: decisions run with thinking off")
    return value


def _version(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value != PROMPT_FORMAT_VERSION:
        raise ValueError(f"prompt_format_version {value!r} is not supported; this server speaks version 1")
    return value


class DecisionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str
    # The bounds in /openapi.json too; `_questions` refuses a count outside them in its own words.
    questions: Annotated[list[Question], Field(json_schema_extra={"minItems": 1, "maxItems": MAX_QUESTIONS})]
    temperature: Annotated[float | None, BeforeValidator(float_field("temperature", 0.0, low_open=True))] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_template_kwargs)] = None
    prompt_format_version: Annotated[int | None, BeforeValidator(_version)] = None
    return_prompt_token_ids: Annotated[bool | None, BeforeValidator(bool_field("return_prompt_token_ids"))] = None

    @field_validator("questions")
    @classmethod
    def _questions(cls, questions: list[Any]) -> list[Any]:
        if not 1 <= len(questions) <= MAX_QUESTIONS:
            raise ValueError(f"questions must hold 1 to {MAX_QUESTIONS} questions, got {len(questions)}")
        return questions

    @property
    def softmax_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature


def _param(loc: tuple[int | str, ...], kind: str) -> str:
    """`questions[1].options` from pydantic's ('questions', 1, 'choice', 'options'): the union tag dropped."""
    parts = list(loc)
    if len(parts) > 2 and parts[0] == "questions" and parts[2] in QUESTION_TYPES:
        del parts[2]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        parts.append("type")
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _first_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False)[0]
    param = _param(tuple(first.get("loc", ())), str(first.get("type", "")))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        message = f"a question's type must be one of {', '.join(QUESTION_TYPES)}"
    return bad_request(f"{param}: {message}" if param else message, param or None)


def parse_decisions(body: dict[str, Any]) -> DecisionRequest:
    """The validated body, or the first problem as a 400 naming the field (`questions[i].id` for duplicates)."""
    try:
        fields = DecisionRequest.model_validate(body)
    except ValidationError as exc:
        raise _first_error(exc) from None
    seen: dict[str, int] = {}
    for index, question in enumerate(fields.questions):
        if question.id in seen:
            param = f"questions[{index}].id"
            raise bad_request(
                f"{param}: the id {question.id!r} is already used by questions[{seen[question.id]}]", param
            )
        seen[question.id] = index
    return fields
