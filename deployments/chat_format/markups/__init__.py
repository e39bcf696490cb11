"""Tool-call markup families, one file each, behind one registry: which family a template teaches, and by name.

Each family is a ToolMarkup (base.py): glm.py (GLM), qwen_xml.py (the XML of Qwen3-Coder, Qwen3.5 and
Nemotron 3), gemma.py (Gemma 4's, its value syntax in gemma_values.py and its grammar in gemma_grammar.py),
hermes.py (Qwen3's Hermes JSON); grammar_pieces.py holds what their forced-call grammars are
built from. To add a family, write its file and put an instance in FAMILIES ahead of every family its
templates would also pass for: templates are matched in FAMILIES' order, so Hermes, which any `<tool_call>`
passes for, stays last.
"""

from deployments.chat_format.markups.base import ToolMarkup
from deployments.chat_format.markups.gemma import GemmaMarkup
from deployments.chat_format.markups.glm import GlmMarkup
from deployments.chat_format.markups.hermes import HermesMarkup
from deployments.chat_format.markups.qwen_xml import QwenXmlMarkup

FAMILIES: tuple[ToolMarkup, ...] = (GlmMarkup(), QwenXmlMarkup(), GemmaMarkup(), HermesMarkup())  # most specific first

# The names ReplyFormat.tool_format carries.
GLM = GlmMarkup.name
QWEN_XML = QwenXmlMarkup.name
GEMMA = GemmaMarkup.name
HERMES = HermesMarkup.name


def markup_for_template(source: str | None) -> ToolMarkup | None:
    """The family a chat template teaches its model (None: the template shows no tool calls)."""
    if not source:
        return None
    return next((family for family in FAMILIES if family.shown_in(source)), None)


def markup_named(name: str | None) -> ToolMarkup | None:
    """The family ReplyFormat.tool_format names (None: no markup, or a name no family here has)."""
    return next((family for family in FAMILIES if family.name == name), None) if name else None
