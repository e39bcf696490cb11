"""The generation fields chat completions and completions share, typed: sampling, limits, stops, streaming,
vLLM's extras, structured output and logprobs.

Unknown fields are allowed and ignored (clients send many harmless ones: `user`, `metadata`, `store`);
fields this server cannot honour (suffix, penalties, logit_bias, best_of) are refused with 400 rather than
silently dropped, because ignoring them would change what the client gets. Those refusals read the body as
sent, before it is parsed (`refuse_unsupported`), so they answer ahead of any malformed field.

Structured output (deployments/ingress/grammar_fields.py) is typed and checked here too: its fields' shapes,
one field at most, a grammar that compiles. Each family adds its logprob fields, typed here too with the
combinations they refuse (`chat_logprobs`, `top_count`, `refuse_combinations`).
"""

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from deployments.ingress.field_paths import FieldError
from deployments.ingress.grammar_fields import (
    GRAMMAR_FIELDS,
    GuidedChoice,
    GuidedJson,
    GuidedText,
    ResponseFormat,
    StructuredOutputs,
    requested_grammar,
)
from deployments.ingress.http.errors import bad_request
from deployments.ingress.sampling_fields import (
    SEED_MAX,
    SEED_MIN,
    StopField,
    bool_field,
    float_field,
    int_field,
    token_ids_field,
)
from deployments.messages.requests import GrammarSpec, Priority

_UNSUPPORTED = (  # field -> why; refused when present with a value that asks for something
    # logprobs and top_logprobs: below; structured output: grammar_fields, and chat_run for a forced call;
    # prompt_logprobs and echo: completions only (deployments.ingress.openai.models refuses them on chat)
    ("suffix", "suffix is not supported"),
)
_ZERO_ONLY = ("frequency_penalty", "presence_penalty")  # accepted at their neutral value only


def _priority(value: Any) -> Priority:
    """`background` / `foreground`, or vLLM's integer priority (larger = later, so > 0 is background)."""
    if value is None:
        return Priority.FOREGROUND
    if isinstance(value, str) and value.strip().lower() in ("background", "foreground"):
        return Priority(value.strip().lower())
    if isinstance(value, int) and not isinstance(value, bool):
        return Priority.BACKGROUND if value > 0 else Priority.FOREGROUND
    raise ValueError("priority must be 'background', 'foreground' or an integer")


# What _priority reads, as /openapi.json documents it.
_PRIORITY_SCHEMA = {"anyOf": [{"enum": [p.value for p in Priority]}, {"type": "integer"}, {"type": "null"}]}
PriorityField = Annotated[Priority, BeforeValidator(_priority), WithJsonSchema(_PRIORITY_SCHEMA)]


def _requested(name: str, value: Any) -> bool:
    """Whether an optional feature field actually asks for the feature (null, false, empty do not)."""
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, dict, str)) and not value)


def unsupported_field(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first field asking for something this server does not do yet, as (param, message)."""
    for name, why in _UNSUPPORTED:
        if _requested(name, body.get(name)):
            return name, f"{name}: {why}"
    for name in _ZERO_ONLY:
        value = body.get(name)
        if isinstance(value, bool) or value not in (None, 0, 0.0):
            return name, f"{name}: only 0 is supported"
    if body.get("logit_bias"):
        return "logit_bias", "logit_bias: not supported"
    if body.get("best_of") not in (None, 1):
        return "best_of", "best_of: must be 1"
    return None


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming the first field `unsupported_field` finds in the body as sent."""
    refused = unsupported_field(body)
    if refused is not None:
        raise bad_request(refused[1], refused[0])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Annotated[bool | None, BeforeValidator(bool_field("stream_options.include_usage"))] = None


class GenerationFields(BaseModel):
    """The fields chat and completions share: sampling, limits, stops, streaming and vLLM's extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: Annotated[float | None, BeforeValidator(float_field("temperature", low=0.0))] = None
    top_p: Annotated[float | None, BeforeValidator(float_field("top_p", low=0.0, high=1.0, low_open=True))] = None
    top_k: Annotated[int | None, BeforeValidator(int_field("top_k"))] = None
    min_p: Annotated[float | None, BeforeValidator(float_field("min_p", low=0.0, high=1.0))] = None
    seed: Annotated[int | None, BeforeValidator(int_field("seed", SEED_MIN, SEED_MAX))] = None
    max_tokens: Annotated[int | None, BeforeValidator(int_field("max_tokens", low=1))] = None
    max_completion_tokens: Annotated[int | None, BeforeValidator(int_field("max_completion_tokens", low=1))] = None
    stop: StopField = Field(default_factory=list)
    stop_token_ids: Annotated[list[int], BeforeValidator(token_ids_field("stop_token_ids"))] = Field(
        default_factory=list
    )
    ignore_eos: Annotated[bool | None, BeforeValidator(bool_field("ignore_eos"))] = None
    priority: PriorityField = Priority.FOREGROUND
    n: Annotated[int | None, BeforeValidator(int_field("n"))] = None
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None
    stream_options: StreamOptions | None = None
    return_token_ids: Annotated[bool | None, BeforeValidator(bool_field("return_token_ids"))] = None
    draft: Annotated[bool | None, BeforeValidator(bool_field("draft"))] = None  # false: the serial reference
    # Structured output: at most one of these (deployments.ingress.grammar_fields.requested_grammar).
    response_format: ResponseFormat = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    structured_outputs: StructuredOutputs = None  # vLLM's: exactly one of json, json_object, regex, choice, grammar
    guided_json: GuidedJson = None  # vLLM's older names: a schema, a regex, a choice list, an EBNF grammar
    guided_regex: GuidedText = None
    guided_choice: GuidedChoice = None
    guided_grammar: GuidedText = None
    # Accepted at their neutral value only; anything else was refused before parsing (refuse_unsupported).
    suffix: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None

    _grammar: GrammarSpec | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_grammar(self) -> "GenerationFields":
        self._grammar = requested_grammar({name: getattr(self, name) for name in GRAMMAR_FIELDS})
        return self

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        return value

    @property
    def grammar(self) -> GrammarSpec | None:
        """The grammar the structured-output fields ask for, compiled when the body was parsed."""
        return self._grammar

    @property
    def reply_limit(self) -> int | None:
        """The explicit reply limit (max_completion_tokens wins, as in OpenAI)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def wants_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_TOP = 20


def _top(name: str) -> Any:
    def check(value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
            raise ValueError(f"{name} must be an integer from 0 through {MAX_TOP}")
        return value

    return check


def top_count(name: str) -> Any:
    """The type of a count of best tokens per row, 0 through MAX_TOP, or null."""
    schema = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP}, {"type": "null"}], "default": None}
    return Annotated[int | None, BeforeValidator(_top(name)), WithJsonSchema(schema)]


def chat_logprobs(wanted: bool | None, top: int | None) -> int | None:
    """Alternatives per row for a chat body's `logprobs` and `top_logprobs` (None: no logprobs)."""
    if not wanted:
        if top not in (None, 0):
            raise FieldError("top_logprobs", "needs logprobs: true")
        return None
    return 0 if top is None else top


def refuse_combinations(grammar: bool, tools: Any, stop: Any, thinking_budget: Any) -> None:
    """The refusals for logprobs with a grammar (forced tool calls included), tools, stop strings or a
    thinking budget, naming the field that rules them out."""
    for present, param, what in (
        (grammar, "logprobs", "structured output"),
        (bool(tools), "tools", "tools"),
        (bool(stop), "stop", "stop strings"),
        (bool(thinking_budget), "thinking_budget", "a thinking budget"),
    ):
        if present:
            raise FieldError(param, f"logprobs cannot be combined with {what}")
