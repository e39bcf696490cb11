"""The grammar a chat reply runs under, once its prompt is rendered: the body's own (checked as it was parsed,
deployments/ingress/grammar_fields.py), or a forced tool call's, gated after the think block.

Only what needs the rendered prompt is here: `tool_choice: "required"` or a named function is a grammar over
the template's call markup (which the Renderer names), and with thinking on the grammar starts after the
think closer the template uses. Every other refusal came when the body was parsed.
"""

from dataclasses import replace
from typing import Any

from deployments.ingress.chat_request import ChatCompletionRequest
from deployments.ingress.http.errors import bad_request
from deployments.messages.render import ReplyFormat
from deployments.messages.requests import GrammarSpec


def gate_after_thinking(spec: GrammarSpec, reply: ReplyFormat) -> GrammarSpec:
    """With thinking on, the grammar starts after the think closer (the reply may open a block first)."""
    if reply.think_closer_id is None or reply.enable_thinking is False:
        return spec
    opener = None if reply.prompt_opens_thinking else reply.think_opener_id
    return replace(
        spec,
        think_closer_id=reply.think_closer_id,
        starts_in_think=reply.prompt_opens_thinking,
        think_opener_id=opener,
    )


def forced_tool_grammar(fields: ChatCompletionRequest, reply: ReplyFormat) -> GrammarSpec:
    """`tool_choice: "required"` or a named function as a grammar over the template's call markup (the body's
    model checked the choice against the tools; the markup is known once the template is)."""
    from deployments.chat_format.forced_calls import forced_call_ebnf  # imports xgrammar, as grammar_fields does

    tools: Any = fields.offered_tools
    try:
        source = forced_call_ebnf(tools, reply.tool_format, parallel=fields.parallel_tool_calls is not False)
    except Exception as exc:  # no markup, or a parameter schema xgrammar cannot take
        raise bad_request(f"tool_choice: a call cannot be forced: {exc}", "tool_choice") from None
    return GrammarSpec("ebnf", source, param="tool_choice")


def reply_grammar(fields: ChatCompletionRequest, reply: ReplyFormat) -> GrammarSpec | None:
    """The grammar the reply runs under (None: unconstrained)."""
    grammar = forced_tool_grammar(fields, reply) if fields.forces_call else fields.grammar
    return None if grammar is None else gate_after_thinking(grammar, reply)
