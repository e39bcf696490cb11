"""The interface every tool-call markup family implements (one file per family beside this one).

A reply writes its calls in call blocks: `call_open`, a body, `call_close`. The reply parser
(chat_format/reply_parser.py) finds the blocks by those markers and asks the family what a body holds; the
forced-call grammar (chat_format/forced_calls.py) repeats the family's `call_grammar`. Neither knows more
about a family than this class says.
"""

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from deployments.chat_format.tool_calls import ParsedCall

if TYPE_CHECKING:
    import xgrammar as xgr


class ToolMarkup(ABC):
    """One family of tool-call markup, as a chat template teaches it and a model writes it."""

    name: ClassVar[str]  # what ReplyFormat.tool_format carries from the Renderer to Ingress
    call_open: ClassVar[str] = "<tool_call>"  # opens a call block in the reply
    call_close: ClassVar[str] = "</tool_call>"  # closes it
    # What the template writes after a turn's calls in place of the turn's end (None: the end token itself);
    # the reply ends there, and what a model writes past it is not the reply's.
    turn_end: ClassVar[str | None] = None

    def shown_in(self, source: str) -> bool:
        """Whether a chat template's source teaches this markup (the registry asks families in its order).

        The call opener shows it, unless other families share the opener: those override this with what
        sets them apart, and the registry asks them first."""
        return self.call_open in source

    @abstractmethod
    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
        """The calls one block's body holds, in order; None when it is not calls (the block stays content).

        Every family so far writes one call per block; a family whose block wraps several (as DeepSeek's
        `tool_calls` block wraps its invokes) returns them all. `schemas` is tool_calls.tool_schemas's map.
        """

    def close_cut(self, body: str) -> str | None:
        """A body an end token cut off, its markup closed where that leaves no doubt (None: it stays content)."""
        return body

    @abstractmethod
    def call_grammar(self, tool: dict[str, Any]) -> "xgr.Grammar":
        """One block calling `tool`, markers included, its arguments inside the tool's parameter schema.

        Import xgrammar (or grammar_pieces) inside: it pulls in transformers, which Ingress loads only
        when a call is forced.
        """
