"""vLLM's `prompt_logprobs` on non-streamed /v1/completions: the request field and the reply's rows.

`choices[0].prompt_logprobs` has one entry per prompt token: null for the first (nothing precedes it),
then an object keyed by token id (a string) whose first key is the prompt token itself, followed by the
requested best tokens; each value has logprob, rank and decoded_token. The prompt token's rank counts every
token at or above it (vLLM's); best tokens are ranked by place, and one that is the prompt token is listed
once, as the first key. Chat and streamed requests are refused with 400 as the body is parsed
(deployments/ingress/openai/models.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deployments.ingress.backend import Backend
from deployments.ingress.openai.logprobs import token_bytes
from deployments.messages.replies import EngineChunk, PromptLogprobRow


def rows_of(chunks: Sequence[EngineChunk]) -> list[PromptLogprobRow]:
    """A reply's prompt rows (they ride on one chunk, the first after the prompt pass)."""
    return next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), [])


@dataclass
class PromptLogprobs:
    """A completion's `prompt_logprobs` field: `top` best tokens per row (the engine may have listed more,
    for an echo asking for more alternatives), each token named through the backend."""

    backend: Backend
    top: int

    async def framed(self, rows: list[PromptLogprobRow]) -> list[dict[str, dict[str, Any]] | None]:
        """The `prompt_logprobs` list: null for the first prompt token, then one entry per row."""
        ids = sorted({r.token_id for r in rows} | {t for r in rows for t, _ in r.top[: self.top]})
        strs = await self.backend.token_strs(ids)
        text = {i: token_bytes(s).decode(errors="replace") for i, s in zip(ids, strs)}
        framed: list[dict[str, dict[str, Any]] | None] = [None]
        for row in rows:
            entry = {str(row.token_id): _value(row.logprob, row.rank, text[row.token_id])}
            for place, (token, logprob) in enumerate(row.top[: self.top], start=1):
                entry.setdefault(str(token), _value(logprob, place, text[token]))  # the prompt token stays first
            framed.append(entry)
        return framed


def _value(logprob: float, rank: int, decoded: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded}
