"""Think-block markup: where a reply's reasoning starts and ends, and what is derived from it.

Two families so far: `<think>` ... `</think>` (GLM, Qwen, Nemotron) and Gemma 4's thought channel,
`<|channel>thought\\n` ... `<channel|>`. The Renderer picks the template's family (`think_for_template`) and
derives ReplyFormat's think fields from it (rendering.py: the two tokens' ids, the forced close's ids,
whether the prompt ends inside a block or with a closed one); the reply parser finds the block with the
family ReplyFormat names (reply_parser.py).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkMarkup:
    """The two markers of a think block, and what a reply writes around them."""

    name: str  # what ReplyFormat.think_format carries from the Renderer to Ingress
    opener: str  # starts reasoning, written by the prompt or first thing in the reply
    closer: str  # ends it; the answer follows
    label: str = ""  # markup the opener is followed by before the reasoning itself (Gemma's channel name)
    forced_close: str = ""  # what the engine writes to close a block a thinking budget ended

    def prompt_opens(self, prompt: str) -> bool:
        """The rendered prompt ends inside an open block: the reply starts as reasoning."""
        end = prompt.rstrip()
        return end.endswith(self.opener) or bool(self.label) and end.endswith(self.opener + self.label.rstrip())

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

    def reasoning(self, block: str, final: bool) -> str:
        """The reasoning a block's text (what follows the opener) holds: the label is markup, and while the
        reply is still arriving a block that may yet be the label shows nothing."""
        body = block.lstrip()
        if self.label and not final and self.label.startswith(body):
            return ""
        return body.removeprefix(self.label).strip()


THINK = ThinkMarkup(name="think", opener="<think>", closer="</think>", forced_close="\n</think>\n\n")
# Gemma 4: the template closes a shown block as `\n<channel|>` and writes the answer right after it.
CHANNEL = ThinkMarkup(
    name="channel", opener="<|channel>", closer="<channel|>", label="thought\n", forced_close="\n<channel|>"
)
FAMILIES: tuple[ThinkMarkup, ...] = (CHANNEL, THINK)  # the first a template shows wins; `<think>` is the default


def think_for_template(source: str | None) -> ThinkMarkup:
    """The think family a chat template writes (`<think>` when it shows none: the checkpoint may still)."""
    return next((family for family in FAMILIES if source and family.opener in source), THINK)


def think_named(name: str | None) -> ThinkMarkup:
    """The family ReplyFormat.think_format names (`<think>` for a name no family here has)."""
    return next((family for family in FAMILIES if family.name == name), THINK)
