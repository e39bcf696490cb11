"""The ops routes' typed bodies: /tokenize and /detokenize (vLLM's fields), and how each body is read.

The imprint routes take a chat completion's body (deployments/ingress/chat_request.py), refused as that
request would be refused.
"""

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from deployments.ingress.chat_request import (
    ChatCompletionRequest,
    Effort,
    GenerationPrompt,
    OptionalMessages,
    TemplateKwargs,
    ToolChoice,
    offered_tools,
)
from deployments.ingress.http.errors import parse_body
from deployments.ingress.request_fields import refuse_unsupported
from deployments.ingress.sampling_fields import bool_field, token_ids_field
from deployments.ingress.tool_checks import CHAT, check_tools


class TokenizeRequest(BaseModel):
    """POST /tokenize: vLLM's fields (a prompt string, or messages with the chat fields)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: OptionalMessages = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    add_generation_prompt: GenerationPrompt = None
    add_special_tokens: Annotated[bool | None, BeforeValidator(bool_field("add_special_tokens"))] = None
    return_token_strs: Annotated[bool | None, BeforeValidator(bool_field("return_token_strs"))] = None
    reasoning_effort: Effort = None  # as chat renders it
    tool_choice: ToolChoice = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        return offered_tools(self.tools, self.tool_choice)


class DetokenizeRequest(BaseModel):
    """POST /detokenize: token ids to text, special tokens included."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: Annotated[list[int], BeforeValidator(token_ids_field("tokens", nullable=False))]


def read_tokenize_body(body: dict[str, Any]) -> TokenizeRequest:
    """The tools chat would render are checked as chat checks them, first."""
    check_tools(body.get("tools"), CHAT)
    return parse_body(TokenizeRequest, body)


def read_imprint_body(body: dict[str, Any]) -> ChatCompletionRequest:
    """A chat completion's body, refused as the chat route refuses it (fields it cannot honour first)."""
    refuse_unsupported(body)
    check_tools(body.get("tools"), CHAT)
    return parse_body(ChatCompletionRequest, body)
