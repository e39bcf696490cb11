"""The logprob request fields of the OpenAI routes, checked once the grammar is known.

Chat: `logprobs: true` with `top_logprobs` 0..20. Completions: the legacy integer `logprobs` 0..20. Refused,
as docs/api.md lists: logprobs with a grammar, tools, stop strings or a thinking budget (rows would not
line up with the text). How the rows are framed: deployments/ingress/openai/logprobs.py.
"""

from typing import Any

from deployments.ingress.http.errors import bad_request
from deployments.messages.requests import GrammarSpec

MAX_TOP = 20


def top_count(value: Any, param: str) -> int:
    """A count of best tokens per row: an integer from 0 through MAX_TOP."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP:
        raise bad_request(f"{param} must be an integer from 0 through {MAX_TOP}", param)
    return value


def chat_logprobs(wanted: Any, top: Any) -> int | None:
    """Alternatives per row for a chat body's `logprobs` and `top_logprobs` (None: no logprobs)."""
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("logprobs must be a boolean", "logprobs")
    if not wanted:
        if top not in (None, 0):
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return 0 if top is None else top_count(top, "top_logprobs")


def completion_logprobs(value: Any) -> int | None:
    """Alternatives per row for a completions body (the legacy integer `logprobs`)."""
    return None if value is None else top_count(value, "logprobs")


def refuse_combinations(grammar: GrammarSpec | None, tools: Any, stop: Any, thinking_budget: Any) -> None:
    """The 400s for logprobs with a grammar, tools, stop strings or a thinking budget."""
    for present, param, what in (
        (grammar is not None, "logprobs", "structured output"),
        (bool(tools), "tools", "tools"),
        (bool(stop), "stop", "stop strings"),
        (bool(thinking_budget), "thinking_budget", "a thinking budget"),
    ):
        if present:
            raise bad_request(f"logprobs cannot be combined with {what}", param)
