"""A chat reply's text split into reasoning, content and tool calls, streamed and whole alike.

`ReplyParser.view` parses the whole text so far. A non-final view holds back whatever later text could
still change (a partial marker, an open call block, trailing whitespace), so every non-final view is a
prefix of the final one; `ReplyStream` sends the differences, and the joined deltas equal the whole reply.

Rules: a reply-written leading think opener is removed when the template supplies no opener; reasoning
ends at the closer, or where a tool call starts when the reply ends inside the block; a call only mentioned
while thinking (the block closed after it) stays reasoning; a call block that does not parse stays content;
an end token inside a call block closes its markup when it then parses strictly; a family's turn end after
calls (Gemma's `<|tool_response>`) ends the reply there. The think markup is the
template's family (think.py), the call markup its call family (markups/), known only through ToolMarkup.
`ReplyReader` is one reply's reading as every chat family's framer takes it: whole, or streamed.
"""

from dataclasses import dataclass, field
from typing import Any

from deployments.chat_format.markups import ToolMarkup, markup_named
from deployments.chat_format.think import think_named
from deployments.chat_format.tool_calls import ParsedCall, tool_schemas
from deployments.messages.render import ReplyFormat


@dataclass
class ReplyView:
    reasoning: str | None  # None: the reply has no think section
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class ReplyDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, ParsedCall]] = field(default_factory=list)  # (index in tool_calls, call)


def _without_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` less a suffix that could be the start of a marker still being written."""
    for cut in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-cut:]) for m in markers):
            return text[:-cut]
    return text


class ReplyParser:
    def __init__(
        self, reply: ReplyFormat, tools: list[dict[str, Any]] | None = None, parallel_tool_calls: bool = True
    ) -> None:
        self.reply = reply
        self.think = think_named(reply.think_format)
        self.markup = markup_named(reply.tool_format) if tools else None  # calls are parsed only when tools are offered
        self.schemas = tool_schemas(tools)
        self.parallel = parallel_tool_calls

    def view(self, text: str, final: bool, ended_by_end_token: bool = False) -> ReplyView:
        start = self._think_start(text, final)
        if start is None:
            return ReplyView(None, "")  # a leading `<think>` may still be arriving
        reasoning: str | None = None
        answer = text
        if start >= 0:
            reasoning, answer = self._split_think(text, start, final)
            if answer is None:
                return ReplyView(reasoning, "")
        content, calls = self._answer(answer, final, ended_by_end_token)
        if reasoning is not None or self.reply.prompt_closes_thinking:
            content = content.lstrip()  # the blank line after the think block is markup
        if not final or calls:
            content = content.rstrip()  # held until more text shows it is not the end
        return ReplyView(reasoning, content, calls if self.parallel else calls[:1])

    def _think_start(self, text: str, final: bool) -> int | None:
        """Where reasoning starts (-1: no think section; None: cannot tell yet)."""
        return 0 if self.reply.prompt_opens_thinking else self.think.reply_opening(text, final)

    def _split_think(self, text: str, start: int, final: bool) -> tuple[str, str | None]:
        think = self.think
        close = text.find(think.closer, start)
        if close >= 0:
            return think.reasoning(text[start:close], True), text[close + len(think.closer) :]
        call_open = self.markup.call_open if self.markup else None
        call_at = text.find(call_open, start) if call_open else -1
        if final:
            if call_at >= 0:  # the reply ended inside the block: a call written there is the reply's call
                return think.reasoning(text[start:call_at], True), text[call_at:]
            return think.reasoning(text[start:], True), ""
        markers = (think.closer, call_open) if call_open else (think.closer,)
        shown = text[start:call_at] if call_at >= 0 else _without_partial(text[start:], markers)
        return think.reasoning(shown, False), None

    def _answer(self, answer: str, final: bool, ended_by_end_token: bool) -> tuple[str, list[ParsedCall]]:
        markup = self.markup
        if markup is None:
            return answer, []
        if markup.turn_end and markup.turn_end in answer:  # the turn ended there: the rest is not the reply's
            answer, final = answer[: answer.index(markup.turn_end)], True
        held = (markup.call_open, markup.turn_end) if markup.turn_end else (markup.call_open,)
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            opened = answer.find(markup.call_open, pos)
            if opened < 0:
                tail = answer[pos:]
                content.append(tail if final else _without_partial(tail, held))
                break
            content.append(answer[pos:opened])
            body_at = opened + len(markup.call_open)
            closed = answer.find(markup.call_close, body_at)
            if closed < 0:
                if final:
                    cut = self._cut_calls(markup, answer[body_at:]) if ended_by_end_token else None
                    if cut is None:
                        content.append(answer[opened:])
                    else:
                        calls.extend(cut)
                break  # not final: the open block is held until it closes or the reply ends
            parsed = markup.parse_calls(answer[body_at:closed], self.schemas)
            if parsed is None:
                content.append(answer[opened : closed + len(markup.call_close)])
            else:
                calls.extend(parsed)
            pos = closed + len(markup.call_close)
        return "".join(content), calls

    def _cut_calls(self, markup: ToolMarkup, body: str) -> list[ParsedCall] | None:
        closed = markup.close_cut(body)
        return None if closed is None else markup.parse_calls(closed, self.schemas)


class ReplyStream:
    """Feeds text deltas, returns reasoning/content/call deltas; `finish` flushes what was held."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.text = ""
        self.shown = ReplyView(None, "")

    def feed(self, text: str) -> ReplyDelta:
        self.text += text
        return self._advance(self.parser.view(self.text, final=False))

    def finish(self, ended_by_end_token: bool) -> ReplyDelta:
        return self._advance(self.parser.view(self.text, final=True, ended_by_end_token=ended_by_end_token))

    def _advance(self, view: ReplyView) -> ReplyDelta:
        old = self.shown
        old_reasoning = old.reasoning or ""
        new_reasoning = view.reasoning or ""
        delta = ReplyDelta(
            reasoning=new_reasoning[len(old_reasoning) :] if new_reasoning.startswith(old_reasoning) else "",
            content=view.content[len(old.content) :] if view.content.startswith(old.content) else "",
            calls=[(i, c) for i, c in enumerate(view.calls) if i >= len(old.calls)],
        )
        self.shown = view
        return delta


@dataclass
class ReplyReader:
    """One reply's parsing state (the parser is the template's; the stream remembers what was shown)."""

    parser: ReplyParser
    end_token_ids: set[int] = field(default_factory=set)  # the ids that end a reply (EOS and stop ids)
    stream: ReplyStream = field(init=False)  # the streamed parts shown so far

    def __post_init__(self) -> None:
        self.stream = ReplyStream(self.parser)

    def ended_by_end_token(self, finish: str, token_ids: list[int]) -> bool:
        return finish == "stop" and bool(token_ids) and token_ids[-1] in self.end_token_ids

    def whole(self, text: str, finish: str, token_ids: list[int]) -> ReplyView:
        """A finished reply's parts."""
        return self.parser.view(text, final=True, ended_by_end_token=self.ended_by_end_token(finish, token_ids))

    def read(self, text: str) -> ReplyDelta:
        """The parts the next streamed text shows."""
        return self.stream.feed(text)

    def read_end(self, finish: str, token_ids: list[int]) -> ReplyDelta:
        """The parts held back until the reply finished."""
        return self.stream.finish(self.ended_by_end_token(finish, token_ids))
