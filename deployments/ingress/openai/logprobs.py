"""Log probabilities on the OpenAI routes: the rows each reply carries, framed for chat or completions.

Chat rows fill `choices[0].logprobs.content` (token, logprob, bytes, top_logprobs). Completions take the
legacy object (tokens, token_logprobs, top_logprobs, text_offset); a token's legacy text is the characters
its bytes complete, so the tokens join to the text and text_offset counts characters.
A stream sends each row with the chunk whose text completes that token; with thinking on, rows cover the
answer only (none for the think block, its closer or the blanks after it). The request fields and the
combinations they refuse: deployments/ingress/request_fields.py.
"""

import codecs
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from deployments.ingress.backend import Backend
from deployments.ingress.generation import Generation
from deployments.messages.render import ReplyFormat
from deployments.messages.replies import EngineChunk, LogprobRow


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet: each of the 256 bytes has one printable stand-in character."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(token_str: str) -> bytes:
    """A vocabulary entry's bytes (byte-level alphabet; other characters, e.g. special tokens, as UTF-8)."""
    table = _byte_of_char()
    return b"".join(bytes([table[ch]]) if ch in table else ch.encode() for ch in token_str)


class TokenTexts:
    """Consecutive tokens' texts: each token's text is the characters its bytes complete (a character split
    across tokens belongs to the token that ends it), so the texts join to the bytes decoded as UTF-8."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def text(self, data: bytes, final: bool = False) -> str:
        """The next token's text; `final` flushes an incomplete character at the end as U+FFFD."""
        return self._decoder.decode(data, final)


def legacy_alternatives(text: str, data: bytes, logprob: float, top: list[tuple[bytes, float]]) -> dict[str, float]:
    """A legacy `top_logprobs` entry: vLLM's rule lists the token itself first, then its alternatives."""
    alternatives = {text: logprob}
    alternatives.update({alt.decode(errors="replace"): lp for alt, lp in top if alt != data})
    return alternatives


def legacy_body(
    texts: list[str], logprobs: list[float | None], tops: list[dict[str, float] | None], offset: int
) -> dict[str, Any]:
    """The legacy `logprobs` object of consecutive tokens whose first character is at `offset`."""
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def joined_legacy(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive legacy objects as one (an echoed prompt's rows, then the reply's)."""
    return {key: first[key] + then[key] for key in first}


@dataclass
class _Row:
    row: LogprobRow
    data: bytes
    top: list[tuple[bytes, float]]


@dataclass
class LogprobFramer:
    """One reply's rows: aligned to its text, think block dropped, framed for chat or completions."""

    backend: Backend
    reply: ReplyFormat
    end_ids: set[int]  # ids that end a reply (their rows are not shown, unless keep_end_rows)
    legacy: bool = False  # completions' legacy form
    text_offset: int = 0  # legacy: characters before the reply's first token (an echoed prompt's)
    keep_end_rows: bool = False  # legacy echo: every reply token has its row, an end token's with empty text
    _pending: list[_Row] = field(default_factory=list)
    _held: list[_Row] = field(default_factory=list)  # released but not yet attached to an event
    _token_bytes: int = 0  # bytes of every token seen so far (shown or not)
    _text_bytes: int = 0  # bytes of text the engine has sent so far
    _state: str = ""  # "", "think", "after", "answer"
    _texts: TokenTexts = field(default_factory=TokenTexts)  # legacy token texts, across chunks

    async def _rows(self, rows: list[LogprobRow]) -> list[_Row]:
        ids = sorted({r.token_id for r in rows} | {t for r in rows for t, _ in r.top})
        strs = dict(zip(ids, await self.backend.token_strs(ids)))
        return [_Row(r, token_bytes(strs[r.token_id]), [(token_bytes(strs[t]), lp) for t, lp in r.top]) for r in rows]

    def _shown(self, row: _Row, first: bool) -> bool:
        """Whether a row belongs to the answer (think block, its closer and the blanks after it do not)."""
        token = row.row.token_id
        if not self._state:
            opens = self.reply.prompt_opens_thinking or (first and token == self.reply.think_opener_id)
            self._state = "think" if opens and self.reply.think_closer_id is not None else "answer"
        if self._state == "think":
            if token == self.reply.think_closer_id:
                self._state = "after"
            return False
        if self._state == "after" and not row.data.strip():
            return False
        self._state = "answer"
        return True

    async def release(self, chunk: EngineChunk) -> list[_Row]:
        """The rows whose text this chunk completes (all of them on the last chunk)."""
        self._text_bytes += len(chunk.text.encode())
        first = not self._pending and self._token_bytes == 0
        for row in await self._rows(chunk.logprobs or []):
            self._pending.append(row)
        ready: list[_Row] = []
        while self._pending:
            row = self._pending[0]
            if not chunk.finished and self._token_bytes + len(row.data) > self._text_bytes:
                break
            self._pending.pop(0)
            self._token_bytes += len(row.data)
            if chunk.finished and row.row.token_id in self.end_ids and not self._pending:
                if not self.keep_end_rows:
                    continue  # the end token has no text
                row = _Row(row.row, b"", [(alt, lp) for alt, lp in row.top if alt != row.data])
            if self._shown(row, first):
                ready.append(row)
            first = False
        return ready

    async def attach(self, chunk: EngineChunk, events: list[dict[str, Any]]) -> None:
        """Put the rows this chunk completes on its last event with a choice (held until there is one)."""
        self._held.extend(await self.release(chunk))
        targets = [e for e in events if e.get("choices")]
        if self._held and targets:
            targets[-1]["choices"][0]["logprobs"] = self.framed(self._held, chunk.finished)
            self._held = []

    def framed(self, rows: list[_Row], final: bool) -> dict[str, Any]:
        """The rows' logprobs object; `final`: they end the reply."""
        if self.legacy:
            return self._legacy(rows, final)
        return {"content": [_chat_row(r) for r in rows]}

    def _legacy(self, rows: list[_Row], final: bool) -> dict[str, Any]:
        texts = [self._texts.text(r.data, final and i == len(rows) - 1) for i, r in enumerate(rows)]
        logprobs: list[float | None] = [r.row.logprob for r in rows]
        tops: list[dict[str, float] | None] = [
            legacy_alternatives(t, r.data, r.row.logprob, r.top) for t, r in zip(texts, rows)
        ]
        body = legacy_body(texts, logprobs, tops, self.text_offset)
        self.text_offset += sum(len(t) for t in texts)
        return body


def _chat_row(row: _Row) -> dict[str, Any]:
    def entry(data: bytes, logprob: float) -> dict[str, Any]:
        return {"token": data.decode(errors="replace"), "logprob": logprob, "bytes": list(data)}

    shown = entry(row.data, row.row.logprob)
    shown["top_logprobs"] = [entry(data, lp) for data, lp in row.top]
    return shown


async def whole_reply(framer: LogprobFramer, chunks: list[EngineChunk]) -> dict[str, Any]:
    """The logprobs object of a non-streamed reply."""
    rows: list[_Row] = []
    for chunk in chunks:
        rows.extend(await framer.release(chunk))
    return framer.framed(rows, final=True)


async def logprob_framer(
    backend: Backend, generation: Generation, legacy: bool, echoed: str | None = None
) -> LogprobFramer | None:
    """The reply's logprob rows framer, when its request asked for logprobs; `echoed`: the prompt text an echo
    puts before the reply (its rows come first, and every reply token keeps its row)."""
    request = generation.request
    if request.logprobs is None:
        return None
    card = await backend.card()
    end_ids = set(card.eos_token_ids) | set(request.sampling.stop_token_ids)
    offset = 0 if echoed is None else len(echoed)
    reply = generation.reply or ReplyFormat()
    return LogprobFramer(backend, reply, end_ids, legacy=legacy, text_offset=offset, keep_end_rows=echoed is not None)
