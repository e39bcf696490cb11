"""Think-block markup: where a reply's reasoning starts and ends, and what is derived from it.

Templates so far write reasoning between `<think>` and `</think>`. The Renderer derives ReplyFormat's
think fields from THINK (rendering.py: the two tokens' ids, the forced close's ids, whether the prompt ends
inside a block or with a closed one); the reply parser finds the block with it (reply_parser.py).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkMarkup:
    """The two markers of a think block."""

    opener: str  # starts reasoning, written by the prompt or first thing in the reply
    closer: str  # ends it; the answer follows

    @property
    def forced_close(self) -> str:
        """What the engine writes to close a block a thinking budget ended: the closer alone on its line,
        then the blank line templates put before the answer."""
        return f"\n{self.closer}\n\n"

    def prompt_opens(self, prompt: str) -> bool:
        """The rendered prompt ends inside an open block: the reply starts as reasoning."""
        return prompt.rstrip().endswith(self.opener)

    def prompt_closes(self, prompt: str) -> bool:
        """The prompt ends with a closed (empty) block: thinking is off."""
        return prompt.rstrip().endswith(self.closer)

    def reply_opening(self, text: str, final: bool) -> int | None:
        """Where reasoning starts after an opener the reply writes first (-1: none; None: cannot tell yet)."""
        stripped = text.lstrip()
        if stripped.startswith(self.opener):
            return len(text) - len(stripped) + len(self.opener)
        if not final and self.opener.startswith(stripped):
            return None
        return -1


THINK = ThinkMarkup(opener="<think>", closer="</think>")
