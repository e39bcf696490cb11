"""Typed request bodies of the OpenAI-compatible routes (chat, completions, tokenize, detokenize).

Unknown fields are allowed and ignored (clients send many harmless ones: `user`, `metadata`, `store`);
fields this server cannot honour yet (logprobs, structured output, penalties) are refused with 400
rather than silently dropped, because ignoring them would change what the client gets.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from deployments.chat_format.effort import check_effort
from deployments.ingress.sampling_fields import (
    SEED_MAX,
    SEED_MIN,
    bool_field,
    float_field,
    int_field,
    stop_field,
    token_ids_field,
)
from deployments.messages.requests import Priority

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_UNSUPPORTED = (  # field -> why; refused when present with a value that asks for something
    # logprobs, top_logprobs and the structured-output fields: deployments.ingress.structured_fields
    # prompt_logprobs: deployments.ingress.openai.prompt_logprobs, echo: deployments.ingress.openai.echo (completions only)
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


def _requested(name: str, value: Any) -> bool:
    """Whether an optional feature field actually asks for the feature (null, false, empty do not)."""
    if value is None or value is False:
        return False
    if name == "top_logprobs" and value == 0 and not isinstance(value, bool):
        return False  # zero alternatives without logprobs asks for nothing
    if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
        return False  # plain text is the default behaviour
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
    stop: Annotated[list[str], BeforeValidator(stop_field)] = Field(default_factory=list)
    stop_token_ids: Annotated[list[int], BeforeValidator(token_ids_field("stop_token_ids"))] = Field(
        default_factory=list
    )
    ignore_eos: Annotated[bool | None, BeforeValidator(bool_field("ignore_eos"))] = None
    priority: Annotated[Priority, BeforeValidator(_priority)] = Priority.FOREGROUND
    n: Annotated[int | None, BeforeValidator(int_field("n"))] = None
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None
    stream_options: StreamOptions | None = None
    return_token_ids: Annotated[bool | None, BeforeValidator(bool_field("return_token_ids"))] = None
    draft: Annotated[bool | None, BeforeValidator(bool_field("draft"))] = None  # false: the serial reference

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("n must be 1: this server returns one choice per request")
        return value

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


def _check_messages(value: Any) -> list[dict[str, Any]]:
    """Messages: objects with a known role and text content (a string, null, or text parts)."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a nonempty list")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise ValueError(f"messages[{index}].role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{index}].content must be a string, null or a list of parts")
        for part_index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"messages[{index}].content[{part_index}]: only text parts are supported "
                    f"(image, audio and video input are not), got type {kind!r}"
                )
    return value


def _check_template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs must be an object or null")
    return value


Messages = Annotated[list[dict[str, Any]], BeforeValidator(_check_messages)]
TemplateKwargs = Annotated[dict[str, Any], BeforeValidator(_check_template_kwargs)]


class ChatFields(BaseModel):
    """What shapes a chat prompt (shared by chat completions and /tokenize with messages)."""

    model_config = ConfigDict(extra="allow")

    messages: Messages
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    add_generation_prompt: Annotated[bool | None, BeforeValidator(bool_field("add_generation_prompt"))] = None


def _effort(value: Any) -> str | None:
    return check_effort(value, "reasoning_effort")


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return value
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')


def offered_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    """The tools the template sees: none when tool_choice is "none" (the manual: it hides them)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, dict):  # a named function is the only tool the template offers
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if isinstance(t, dict) and (t.get("function") or {}).get("name") == name]
    return tools


class ChatCompletionRequest(GenerationFields, ChatFields):
    """POST /v1/chat/completions."""

    reasoning_effort: Annotated[str | None, BeforeValidator(_effort)] = None
    thinking_budget: Annotated[int | None, BeforeValidator(int_field("thinking_budget", low=0))] = None
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(_tool_choice)] = None
    parallel_tool_calls: Annotated[bool | None, BeforeValidator(bool_field("parallel_tool_calls"))] = None

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        return offered_tools(self.tools, self.tool_choice)


class CompletionRequest(GenerationFields):
    """POST /v1/completions: a string prompt, or token ids run as given; nonempty `messages` means chat."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    messages: list[Any] | None = None
    add_special_tokens: Annotated[bool | None, BeforeValidator(bool_field("add_special_tokens"))] = None
    echo: Annotated[bool | None, BeforeValidator(bool_field("echo"))] = None  # deployments.ingress.openai.echo
    # 0 asks for the prompt pass only, which an echo shows (deployments.ingress.openai.echo.check_reply_limit)
    max_tokens: Annotated[int | None, BeforeValidator(int_field("max_tokens", low=0))] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int] | None:
        """A batch of one unwraps; several prompts would be several choices, which this server refuses."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("prompt: one prompt per request (a list of several prompts is not supported)")
            return value[0]
        if isinstance(value, list) and any(isinstance(t, bool) or t < 0 for t in value):
            raise ValueError("prompt token ids must be non-negative integers")
        return value


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's fields (a prompt string, or messages with the chat fields)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    add_generation_prompt: Annotated[bool | None, BeforeValidator(bool_field("add_generation_prompt"))] = None
    add_special_tokens: Annotated[bool | None, BeforeValidator(bool_field("add_special_tokens"))] = None
    return_token_strs: Annotated[bool | None, BeforeValidator(bool_field("return_token_strs"))] = None
    reasoning_effort: Annotated[str | None, BeforeValidator(_effort)] = None  # as chat renders it
    tool_choice: Annotated[str | dict[str, Any] | None, BeforeValidator(_tool_choice)] = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text, special tokens included."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: Annotated[list[int], BeforeValidator(token_ids_field("tokens"))]
