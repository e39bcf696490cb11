"""The logprob request fields of the OpenAI routes, typed and checked as the body is parsed.

Chat: `logprobs: true` with `top_logprobs` 0..20. Completions: the legacy integer `logprobs` 0..20, and vLLM's
`prompt_logprobs` 0..20. Refused, as docs/api.md lists: logprobs with a grammar, tools, stop strings or a
thinking budget (rows would not line up with the text); all of it is known before any work. How the rows
are framed: deployments/ingress/openai/logprobs.py.
"""

from typing import Annotated, Any

from pydantic import BeforeValidator, WithJsonSchema

from deployments.ingress.field_paths import FieldError

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
