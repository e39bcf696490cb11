"""The typed body of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

Top-level fields are checked here; content blocks, tools and tool_choice are checked while they are
translated (deployments.ingress.anthropic.translate), where each refusal can name the block it is about.
Unknown top-level fields are ignored, as Anthropic's clients send several harmless ones.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from deployments.chat_format.effort import check_effort
from deployments.ingress.grammar_fields import compiled
from deployments.ingress.sampling_fields import SEED_MAX, SEED_MIN, bool_field, float_field, int_field
from deployments.messages.requests import GrammarSpec


def _stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError("stop_sequences must be a list of nonempty strings")
    return value


def _system(value: Any) -> str | list[dict[str, Any]] | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) for b in value):
        return value
    raise ValueError("system must be a string or a list of text blocks")


class ThinkingConfig(BaseModel):
    """`thinking`: disabled, enabled with a budget, or adaptive (the model decides how long to think)."""

    model_config = ConfigDict(extra="allow")  # `display` is accepted; it never suppresses the thinking

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int | None, BeforeValidator(int_field("thinking.budget_tokens", low=1))] = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> "ThinkingConfig":
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens is required when thinking.type is enabled")
        return self


def _effort(value: Any) -> str | None:
    return check_effort(value, "output_config.effort")


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, schema: dict[str, Any]) -> dict[str, Any]:
        """The answer's grammar, parsed now: a schema xgrammar cannot take is refused before any work."""
        compiled(GrammarSpec("json_schema", json.dumps(schema), param="response_format"))
        return schema


class OutputConfig(BaseModel):
    """`output_config`: the effort the template hears and an optional JSON schema for the answer."""

    model_config = ConfigDict(extra="forbid")

    effort: Annotated[str | None, BeforeValidator(_effort)] = None
    format: OutputFormat | None = None


class MessagesBody(BaseModel):
    """What shapes the prompt: shared by /v1/messages and /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    system: Annotated[str | list[dict[str, Any]] | None, BeforeValidator(_system)] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(MessagesBody):
    """POST /v1/messages."""

    max_tokens: Annotated[int, BeforeValidator(int_field("max_tokens", low=1))]
    stop_sequences: Annotated[list[str], BeforeValidator(_stop_sequences)] = Field(default_factory=list)
    stream: Annotated[bool | None, BeforeValidator(bool_field("stream"))] = None
    temperature: Annotated[float | None, BeforeValidator(float_field("temperature", low=0.0))] = None
    top_p: Annotated[float | None, BeforeValidator(float_field("top_p", low=0.0, high=1.0, low_open=True))] = None
    top_k: Annotated[int | None, BeforeValidator(int_field("top_k"))] = None
    seed: Annotated[int | None, BeforeValidator(int_field("seed", SEED_MIN, SEED_MAX))] = None
    metadata: dict[str, Any] | None = None
    draft: Annotated[bool | None, BeforeValidator(bool_field("draft"))] = None  # false: the serial reference

    @model_validator(mode="after")
    def _budget_below_limit(self) -> "MessagesRequest":
        """Anthropic's rule: the thinking budget is part of max_tokens, so it must be smaller."""
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if self.max_tokens is None or budget is None:
            return self
        if self.thinking is not None and self.thinking.type == "enabled":
            if budget >= self.max_tokens:
                raise ValueError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})")
        return self


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the Messages body without max_tokens; what it does send is checked as
    /v1/messages checks it, so a body counted here is one that route would run."""

    max_tokens: Annotated[int | None, BeforeValidator(int_field("max_tokens", low=1))] = None  # type: ignore[assignment]
