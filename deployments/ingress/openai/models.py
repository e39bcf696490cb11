"""The OpenAI routes' bodies: the completion model, and how each body is read into its typed model.

A chat completion parses into ChatCompletionRequest (deployments/ingress/chat_request.py, shared with the
families that run as chat); a /v1/completions body with a nonempty `messages` list is a chat body, answered
as chat. Each reader first refuses, in the body as sent, what answers ahead of any malformed field (tools
as chat checks them, unsupported fields, completion-only fields on chat), then parses the body once.
"""

from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from deployments.ingress.chat_request import MESSAGES_SCHEMA, ChatCompletionRequest
from deployments.ingress.field_paths import FieldError
from deployments.ingress.http.errors import bad_request, parse_body
from deployments.ingress.request_fields import GenerationFields, refuse_combinations, refuse_unsupported, top_count
from deployments.ingress.sampling_fields import bool_field, int_field
from deployments.ingress.tool_checks import CHAT, check_tools

_ONLY_COMPLETIONS = "is only supported on /v1/completions with a prompt, not on chat"


class CompletionRequest(GenerationFields):
    """POST /v1/completions: a string prompt, or token ids run as given; nonempty `messages` means chat."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    messages: Annotated[list[Any] | None, WithJsonSchema(MESSAGES_SCHEMA)] = None  # nonempty: read as chat
    add_special_tokens: Annotated[bool | None, BeforeValidator(bool_field("add_special_tokens"))] = None
    echo: Annotated[bool | None, BeforeValidator(bool_field("echo"))] = None  # deployments.ingress.openai.echo
    # 0 asks for the prompt pass only, which an echo shows (checked below)
    max_tokens: Annotated[int | None, BeforeValidator(int_field("max_tokens", low=0))] = None
    logprobs: top_count("logprobs") = None  # the legacy integer: alternatives per row
    prompt_logprobs: top_count("prompt_logprobs") = None  # deployments.ingress.openai.prompt_logprobs
    # Chat's fields, which a completion ignores; with logprobs they are refused as on chat (refuse_combinations).
    tools: SkipJsonSchema[Any] = None
    thinking_budget: SkipJsonSchema[Any] = None

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

    @model_validator(mode="after")
    def _asks(self) -> "CompletionRequest":
        """What the body asks for, checked against the rest of it (before the prompt is tokenised)."""
        if self.prompt is None:
            raise FieldError("prompt", "is required (a string or a list of token ids)")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "must be at least 1 (0 scores the prompt only, with echo: true)")
        if self.prompt_logprobs is not None and self.stream is True:
            raise FieldError("prompt_logprobs", "is only supported on non-streamed requests (stream: false)")
        if self.logprobs is not None:
            refuse_combinations(self.grammar is not None, self.tools, self.stop, self.thinking_budget)
        return self


def asks_for_chat(body: dict[str, Any] | None) -> bool:
    """A /v1/completions body with a nonempty `messages` list takes the chat path."""
    messages = None if body is None else body.get("messages")
    return isinstance(messages, list) and len(messages) > 0


def _refuse_completion_fields(body: dict[str, Any]) -> None:
    """A chat reply has no prompt rows (any value asks for them) and no prompt text to repeat (echo)."""
    if body.get("prompt_logprobs") is not None:
        raise bad_request(f"prompt_logprobs {_ONLY_COMPLETIONS}", "prompt_logprobs")
    if body.get("echo") is not None and body.get("echo") is not False:  # 0 == False, but is no boolean
        raise bad_request(f"echo {_ONLY_COMPLETIONS}", "echo")


def read_chat_body(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completion body; Responses and Messages check their own tool shapes."""
    check_tools(body.get("tools"), CHAT)
    refuse_unsupported(body)
    _refuse_completion_fields(body)
    return parse_body(ChatCompletionRequest, body)


def read_completions_body(body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """A /v1/completions body: chat when it carries messages, else a completion."""
    if asks_for_chat(body):
        return read_chat_body(body)
    refuse_unsupported(body)
    return parse_body(CompletionRequest, body)
