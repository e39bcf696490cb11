"""The Responses request body: typed fields, and the 400 list of what this server does not run.

Sampling fields reuse chat's checks, so a bad value is refused in the same words; fields that ask for
hosted features (built-in tools, background runs, conversations, prompt templates, auto truncation,
log probabilities) are refused by name before any work. Unknown fields are accepted and ignored.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from deployments.ingress.grammar_fields import TextFormat
from deployments.ingress.http.errors import bad_request, parse_body
from deployments.ingress.request_fields import PriorityField
from deployments.ingress.sampling_fields import SEED_MAX, SEED_MIN, StopField, bool_field, float_field, int_field
from deployments.messages.requests import Priority

METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
# OpenAI's `include` names: accepted and ignored, since this server has nothing to add for any of them.
INCLUDE_NAMES = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "message.output_text.logprobs",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)
_HOSTED = (  # field -> why, refused when present with a value that asks for something
    ("background", "background responses are not supported: the reply runs while the request is open"),
    ("conversation", "conversations are not supported: continue with previous_response_id"),
    ("prompt", "prompt templates are not supported: send instructions and input"),
    ("top_logprobs", "log probabilities are not supported on this route"),
    ("logprobs", "log probabilities are not supported on this route"),
)


def _asks(value: Any) -> bool:
    return value is not None and value is not False


def refused_field(body: dict[str, Any]) -> tuple[str, str] | None:
    """The first field asking for a hosted feature this server does not run, as (param, message)."""
    for name, why in _HOSTED:
        value = body.get(name)
        asks = value is not None if name == "top_logprobs" else _asks(value)  # even 0 names log probabilities
        if asks:
            return name, f"{name}: {why}"
    if body.get("truncation") == "auto":
        return "truncation", 'truncation: "auto" is not supported; a prompt over the window is refused instead'
    return None


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("metadata must be an object of string pairs")
    if len(value) > METADATA_PAIRS:
        raise ValueError(f"metadata holds at most {METADATA_PAIRS} pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys are at most {METADATA_KEY_CHARS} characters ({key[:16]!r}...)")
        if not isinstance(item, str):
            raise ValueError(f"metadata[{key!r}] must be a string")
        if len(item) > METADATA_VALUE_CHARS:
            raise ValueError(f"metadata[{key!r}] is longer than {METADATA_VALUE_CHARS} characters")
    return value


def _include(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError("include must be a list of strings")
    unknown = [name for name in value if name not in INCLUDE_NAMES]
    if unknown:
        raise ValueError(f"include: unknown name {unknown[0]!r}; known: {', '.join(sorted(INCLUDE_NAMES))}")
    return value


def _object(name: str) -> Any:
    def check(value: Any) -> dict[str, Any] | None:
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{name} must be an object or null")
        return value

    return check


def _string(name: str) -> Any:
    def check(value: Any) -> str | None:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string or null")
        return value

    return check


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's fields, plus the chat extensions this server passes through)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: Annotated[str | None, BeforeValidator(_string("instructions"))] = None
    previous_response_id: Annotated[str | None, BeforeValidator(_string("previous_response_id"))] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Annotated[bool | None, BeforeValidator(bool_field("parallel_tool_calls"))] = None
    max_output_tokens: Annotated[int | None, BeforeValidator(int_field("max_output_tokens", low=1))] = None
    temperature: Annotated[float | None, BeforeValidator(float_field("temperature", low=0.0))] = None
    top_p: Annotated[float | None, BeforeValidator(float_field("top_p", low=0.0, high=1.0, low_open=True))] = None
    top_k: Annotated[int | None, BeforeValidator(int_field("top_k"))] = None
    min_p: Annotated[float | None, BeforeValidator(float_field("min_p", low=0.0, high=1.0))] = None
    seed: Annotated[int | None, BeforeValidator(int_field("seed", SEED_MIN, SEED_MAX))] = None
    reasoning: Annotated[dict[str, Any] | None, BeforeValidator(_object("reasoning"))] = None
    text: TextFormat = None  # {"format": {...}}: its grammar checked (and compiled) here
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None
    store: Annotated[bool | None, BeforeValidator(bool_field("store"))] = None
    metadata: Annotated[dict[str, str] | None, BeforeValidator(_metadata)] = None
    include: Annotated[list[str] | None, BeforeValidator(_include)] = None
    truncation: str | None = None
    # The chat extensions (checked again, in chat's words, by the chat handler).
    draft: Annotated[bool | None, BeforeValidator(bool_field("draft"))] = None
    thinking_budget: Annotated[int | None, BeforeValidator(int_field("thinking_budget", low=0))] = None
    stop: StopField = Field(default_factory=list)
    ignore_eos: Annotated[bool | None, BeforeValidator(bool_field("ignore_eos"))] = None
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_object("chat_template_kwargs"))] = None
    priority: PriorityField = Priority.FOREGROUND
    # Hosted features, accepted only where they ask for nothing (refused before parsing: refused_field).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    logprobs: Any = None
    top_logprobs: Any = None

    @field_validator("truncation")
    @classmethod
    def _truncation(cls, value: str | None) -> str | None:
        if value not in (None, "disabled", "auto"):
            raise ValueError('truncation must be "disabled" (or "auto", which is refused)')
        return value

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("input must be a nonempty string or a nonempty list of items")
        return value

    @property
    def stores(self) -> bool:
        return self.store is not False  # store defaults to true, as OpenAI's does


def read_responses_body(body: dict[str, Any]) -> ResponsesRequest:
    """A Responses body: a hosted feature is refused by name, in the body as sent, before anything is parsed."""
    refused = refused_field(body)
    if refused is not None:
        raise bad_request(refused[1], refused[0])
    return parse_body(ResponsesRequest, body)
