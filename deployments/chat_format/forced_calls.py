"""Forced tool calls as a grammar over the chat template's own call markup (its family's `call_grammar`).

With `tool_choice: "required"` or a named function, the answer is one or more calls (exactly one when
`parallel_tool_calls` is false), each to an offered tool (the named one only), with arguments inside the
tool's parameter schema; blank lines may separate calls, prose may not. Parsing the reply stays the reply
parser's job: this only constrains generation. Blanks between two calls are bounded as between two JSON
tokens (markups/grammar_pieces.py says how blanks inside a call are bounded); one line break may come
before the first call and after the last, and a family's turn end (ToolMarkup.turn_end) after that.
"""

import json
import re
from typing import Any

import xgrammar as xgr

from deployments.chat_format.markups import markup_named
from deployments.chat_format.markups.grammar_pieces import MAX_BLANKS

# One optional line break before the first call and after the last, as templates lay calls out: GLM-4.6's,
# and Nemotron 3's after a closed think block, put one before a turn's first call; Nemotron 3's ends every
# call's line. Refused, the first would push the model off what it was shown, and the last leave it no end
# but another call.
LINE_BREAK = '"\\n"?'


def forced_call_ebnf(tools: list[dict[str, Any]], markup: str | None, parallel: bool) -> str:
    """The EBNF of a reply made of calls to `tools` in the family named `markup` (ValueError without one)."""
    family = markup_named(markup)
    if family is None:
        raise ValueError("this model's chat template shows no tool-call markup, so a call cannot be forced")
    if not tools:
        raise ValueError("no tools are offered")
    calls = [family.call_grammar(tool) for tool in tools]
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    body = re.sub(r"^root ::=", "forced_call ::=", str(one), flags=re.MULTILINE)  # a rule the new root repeats
    between = f"[ \\n]{{0,{MAX_BLANKS}}}"  # blank lines may separate calls, up to the JSON bound
    repeated = f"forced_call ({between} forced_call)*" if parallel else "forced_call"
    # A template that ends a turn of calls with a marker of its own (Gemma's) lets the model write it.
    end = f" {json.dumps(family.turn_end)}?" if family.turn_end else ""
    return f"root ::= {LINE_BREAK} {repeated} {LINE_BREAK}{end}\n{body}"
