"""vLLM's `echo` on /v1/completions: the reply repeats its prompt first, and with `logprobs` scores it.

The echoed text is the prompt's tokens' texts joined (logprobs.TokenTexts): the prompt as the tokenizer
decodes it, for a string prompt and for token ids alike. With `logprobs: N` the legacy object covers every
prompt token (the first, which nothing precedes, with null token_logprobs and top_logprobs), then every reply
token, an end token included with empty text, so clients can index the rows by token count (lm-eval's
loglikelihood does); text_offset counts from the prompt's first character. The prompt's rows are the engine's
prompt rows (the machinery of `prompt_logprobs`), so such a request computes its whole prompt.
`max_tokens: 0` asks for the prompt pass only: no reply token, finish_reason "length" (without echo it is
refused as the body is parsed, deployments/ingress/openai/models.py). A stream sends the
prompt's text (and rows) as its first chunk, before the reply's. Chat routes refuse `echo`
(deployments/ingress/openai/models.py).
"""

from dataclasses import dataclass
from typing import Any

from deployments.engine_client.engine_reply import GenerationFailed
from deployments.ingress.backend import Backend
from deployments.ingress.openai.logprobs import TokenTexts, joined_legacy, legacy_alternatives, legacy_body, token_bytes
from deployments.messages.replies import PromptLogprobRow


def prompt_rows_top(echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> int | None:
    """Best tokens per prompt row the engine lists: enough for `prompt_logprobs` and for an echo's `logprobs`."""
    wanted = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    return max(wanted, default=None)


@dataclass
class EchoedPrompt:
    """A completion's prompt as its reply repeats it."""

    backend: Backend
    data: list[bytes]  # each prompt token's bytes
    texts: list[str]  # each prompt token's text; joined, the echoed text
    top: int | None  # legacy alternatives per row; None: the request asked for no logprobs

    @property
    def text(self) -> str:
        return "".join(self.texts)

    async def legacy(self, rows: list[PromptLogprobRow]) -> dict[str, Any]:
        """The prompt's legacy logprobs object, from the engine's rows (one per prompt token after the first)."""
        if len(rows) != len(self.data) - 1:
            raise GenerationFailed(f"the engine scored {len(rows)} prompt tokens, not {len(self.data) - 1}")
        top = self.top or 0
        ids = sorted({t for r in rows for t, _ in r.top[:top]})
        alternative = dict(zip(ids, map(token_bytes, await self.backend.token_strs(ids))))
        logprobs: list[float | None] = [None] + [r.logprob for r in rows]
        tops: list[dict[str, float] | None] = [None]
        for text, data, row in zip(self.texts[1:], self.data[1:], rows):
            tops.append(legacy_alternatives(text, data, row.logprob, [(alternative[t], lp) for t, lp in row.top[:top]]))
        return legacy_body(self.texts, logprobs, tops, 0)

    async def prepend(self, choice: dict[str, Any], rows: list[PromptLogprobRow]) -> None:
        """A whole reply's choice with the prompt in front of its text (and of its logprobs rows)."""
        choice["text"] = self.text + choice["text"]
        if self.top is not None:
            choice["logprobs"] = joined_legacy(await self.legacy(rows), choice["logprobs"])


async def echoed_prompt(backend: Backend, prompt_ids: list[int], top: int | None) -> EchoedPrompt:
    data = [token_bytes(s) for s in await backend.token_strs(prompt_ids)]
    texts = TokenTexts()
    return EchoedPrompt(backend, data, [texts.text(d, i == len(data) - 1) for i, d in enumerate(data)], top)
