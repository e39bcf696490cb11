"""The chat completion body, typed: what every chat-shaped family runs as.

Chat completions parse it from the client's body; Messages and Responses build it from their own typed
bodies (`chat_request`), so the one chat handler (deployments/ingress/chat_run.py) only ever sees this
model. The prompt-shaping pieces (messages, template kwargs, effort, tool_choice) are also what /tokenize
and the imprint routes take.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, WithJsonSchema, model_validator

from deployments.chat_format.effort import check_effort
from deployments.ingress.field_paths import FieldError
from deployments.ingress.http.errors import parse_body
from deployments.ingress.request_fields import GenerationFields, chat_logprobs, refuse_combinations, top_count
from deployments.ingress.sampling_fields import bool_field, int_field

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
# Read in user and tool messages with --vision (docs/vision.md): a data: URL, or https:// with --vision-urls.
_IMAGE_PART = {
    "type": "object",
    "required": ["type", "image_url"],
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "required": ["url"],
            "properties": {"url": {"type": "string"}, "detail": {"enum": ["auto", "low", "high"]}},
        },
    },
}
# What `_check_messages` accepts, as /openapi.json documents it (`list[dict]` leaves it unsaid).
MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"enum": list(MESSAGE_ROLES)},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "null"},
                    {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                ]
            },
        },
    },
}


def _check_messages(value: Any) -> list[dict[str, Any]]:
    """Messages: objects with a known role and text content (a string, null, or text and image parts)."""
    if not isinstance(value, list) or not value:
        raise FieldError("", "must be a nonempty list")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise FieldError(f"[{index}]", "must be an object")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise FieldError(f"[{index}].role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise FieldError(f"[{index}].content", "must be a string, null or a list of parts")
        for part_index, part in enumerate(content):
            _check_part(part, f"[{index}].content[{part_index}]")
    return value


def _check_part(part: Any, below: str) -> None:
    """A text part, or an image_url part whose url is a string (the Renderer reads and checks the image)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return
    if kind == "image_url":
        image = part.get("image_url")
        if not isinstance(image, dict):
            raise FieldError(f"{below}.image_url", "must be an object with a url string")
        if not isinstance(image.get("url"), str):
            raise FieldError(f"{below}.image_url.url", "must be a string (a data: URL, or https://)")
        return
    if kind == "text":
        raise FieldError(f"{below}.text", "must be a string")
    why = f"only text and image_url parts are supported (audio, file and video input are not), got type {kind!r}"
    raise FieldError(f"{below}.type" if isinstance(part, dict) else below, why)


def image_part(url: str, field: str) -> dict[str, Any]:
    """Another family's image as the chat part it runs as; `field` names it in the client's own body."""
    return {"type": "image_url", "image_url": {"url": url}, "field": field}


def joined_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text and image parts as chat content: one string where there is no image (what text-only gets)."""
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _check_template_kwargs(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs must be an object or null")
    return value


def _effort(value: Any) -> str | None:
    return check_effort(value, "reasoning_effort")


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return value
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}')


Messages = Annotated[list[dict[str, Any]], BeforeValidator(_check_messages), WithJsonSchema(MESSAGES_SCHEMA)]
OptionalMessages = Annotated[Messages | None, WithJsonSchema(MESSAGES_SCHEMA)]
# Null keeps the server's defaults, as for every optional field (docs/api.md).
TemplateKwargs = Annotated[
    dict[str, Any],
    BeforeValidator(_check_template_kwargs),
    WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "null"}], "default": None}),
]
GenerationPrompt = Annotated[bool | None, BeforeValidator(bool_field("add_generation_prompt"))]
Effort = Annotated[str | None, BeforeValidator(_effort)]
ToolChoice = Annotated[str | dict[str, Any] | None, BeforeValidator(_tool_choice)]


def forces_tool_call(choice: Any) -> bool:
    """`tool_choice: "required"` or a named function (a grammar over the template's call markup)."""
    return choice == "required" or isinstance(choice, dict)


def offered_tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    """The tools the template sees: none when tool_choice is "none" (it hides them)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, dict):  # a named function is the only tool the template offers
        name = (choice.get("function") or {}).get("name")
        return [t for t in tools if isinstance(t, dict) and (t.get("function") or {}).get("name") == name]
    return tools


class ChatFields(BaseModel):
    """What shapes a chat prompt."""

    model_config = ConfigDict(extra="allow")

    messages: Messages
    tools: list[dict[str, Any]] | None = None  # checked as chat checks them (tool_checks.CHAT) before parsing
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    add_generation_prompt: GenerationPrompt = None


class ChatCompletionRequest(GenerationFields, ChatFields):
    """POST /v1/chat/completions."""

    reasoning_effort: Effort = None
    thinking_budget: Annotated[int | None, BeforeValidator(int_field("thinking_budget", low=0))] = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Annotated[bool | None, BeforeValidator(bool_field("parallel_tool_calls"))] = None
    logprobs: Annotated[bool | None, BeforeValidator(bool_field("logprobs"))] = None  # alternatives: top_logprobs
    top_logprobs: top_count("top_logprobs") = None

    _logprob_top: int | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _reply_extras(self) -> "ChatCompletionRequest":
        """A forced call and the logprob fields, checked against the rest of the body (before any work)."""
        if self.forces_call and self.grammar is not None:
            raise FieldError(
                "tool_choice", 'a grammar cannot be combined with tool_choice "required" or a named function'
            )
        if self.forces_call and not self.offered_tools:
            raise FieldError("tool_choice", "the named function is not among the tools")
        self._logprob_top = chat_logprobs(self.logprobs, self.top_logprobs)
        if self._logprob_top is not None:
            forced = self.grammar is not None or self.forces_call
            refuse_combinations(forced, self.tools, self.stop, self.thinking_budget)
        return self

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        return offered_tools(self.tools, self.tool_choice)

    @property
    def forces_call(self) -> bool:
        """The reply must call a tool: tool_choice forces one and tools are given (none given: no call)."""
        return forces_tool_call(self.tool_choice) and bool(self.tools)

    @property
    def logprob_top(self) -> int | None:
        """Alternatives per logprob row (None: no rows)."""
        return self._logprob_top


def chat_request(**fields: Any) -> ChatCompletionRequest:
    """The chat completion another family's body runs as, checked as a client's would be (null fields are
    left out, as a client leaves them out)."""
    return parse_body(ChatCompletionRequest, {name: value for name, value in fields.items() if value is not None})
