"""How one chat reply's text reads as reasoning, content and tool calls, whole or streamed: what every chat
family's framer reads before putting the parts in its own shapes."""

from dataclasses import dataclass, field

from deployments.chat_format.reply_parser import ReplyDelta, ReplyParser, ReplyStream, ReplyView


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
