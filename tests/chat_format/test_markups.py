"""The tool-call markup registry, and a family unlike the built-in ones working through ToolMarkup alone.

Vendor templates pick their family (or none yet). A test family whose block is not `<tool_call>` and
wraps several calls (as DeepSeek's does) is registered the way a new family file would be: the reply
parser reads its calls, streamed and whole alike, and the forced-call grammar holds exactly its calls.
"""

import json
from typing import Any

import pytest
import xgrammar as xgr

from deployments.chat_format import markups
from deployments.chat_format.forced_calls import forced_call_ebnf
from deployments.chat_format.markups import GEMMA, GLM, HERMES, QWEN_XML, ToolMarkup, markup_for_template, markup_named
from deployments.chat_format.reply_parser import ReplyParser
from deployments.chat_format.tool_calls import ParsedCall
from deployments.messages.render import ReplyFormat
from deployments.messages.requests import GrammarSpec
from deployments.scheduler.engine.grammar import GrammarBackend
from deployments.tokenizer import load_tokenizer
from tests.chat_format.test_reply_parser import TOOLS, args, both
from tests.conftest import BUILTIN_TINY_GLM, REPO

VENDOR_TEMPLATES = REPO.parent / "shared" / "fixtures" / "chat_templates"
VENDOR_FAMILIES = {  # template file: the family it teaches (None: no family here knows its markup yet)
    "GLM-4.6.jinja": GLM,
    "GLM-4.7-Flash.jinja": GLM,
    "Qwen3.jinja": HERMES,
    "Qwen3-Coder.jinja": QWEN_XML,
    "Qwen3.5-4B.jinja": QWEN_XML,
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": QWEN_XML,
    "google-gemma-4-31B-it.jinja": GEMMA,
    "deepseek-ai-DeepSeek-V4.jinja": None,
}


@pytest.mark.parametrize("file", sorted(VENDOR_FAMILIES))
def test_vendor_templates_pick_their_family(file: str) -> None:
    path = VENDOR_TEMPLATES / file
    if not path.exists():
        pytest.skip(f"{path} is not beside this checkout (vendor templates live in ../shared)")
    markup = markup_for_template(path.read_text(encoding="utf-8"))
    assert (markup.name if markup else None) == VENDOR_FAMILIES[file]


def test_every_family_is_found_by_its_name() -> None:
    names = [family.name for family in markups.FAMILIES]
    assert len(set(names)) == len(names) and {GLM, QWEN_XML, GEMMA, HERMES} <= set(names)
    assert all(markup_named(name) is family for name, family in zip(names, markups.FAMILIES))
    assert markup_named(None) is None and markup_named("") is None and markup_named("unknown") is None
    assert markup_for_template(None) is None and markup_for_template("") is None
    tiny_glm = REPO / "serve_app" / "fixtures" / "tiny_glm" / "chat_template.jinja"
    assert markup_for_template(tiny_glm.read_text(encoding="utf-8")).name == GLM


class BracketedMarkup(ToolMarkup):
    """`[CALLS][{"name": ..., "arguments": {...}}, ...][/CALLS]`: one block, any number of calls."""

    name = "bracketed"
    call_open = "[CALLS]"
    call_close = "[/CALLS]"

    def parse_calls(self, body: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedCall] | None:
        try:
            calls = json.loads(body)
        except ValueError:
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            return None
        return [ParsedCall(c["name"], json.dumps(c.get("arguments", {}))) for c in calls]

    def close_cut(self, body: str) -> str | None:
        return body + "]" if body.rstrip().endswith("}") else None

    def call_grammar(self, tool: dict[str, Any]) -> xgr.Grammar:
        from deployments.chat_format.markups import grammar_pieces as g

        name, parameters = g.signature(tool)
        head = g.literal(self.call_open + '[{"name": ' + json.dumps(name) + ', "arguments": ')
        return g.concat(head, g.json_value(parameters), g.literal("}]" + self.call_close))


@pytest.fixture
def bracketed(monkeypatch: pytest.MonkeyPatch) -> ReplyFormat:
    """The test family registered ahead of the built-in ones, as a new family's registry entry would be."""
    monkeypatch.setattr(markups, "FAMILIES", (BracketedMarkup(), *markups.FAMILIES))
    return ReplyFormat(tool_format=BracketedMarkup.name)


def test_a_family_with_its_own_markers_and_several_calls_per_block(bracketed: ReplyFormat) -> None:
    assert markup_for_template("{{ '[CALLS]' }} <tool_call>").name == BracketedMarkup.name
    parser = ReplyParser(bracketed, TOOLS)
    block = '[CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}][/CALLS]'
    view = both(parser, "Sure." + block)
    assert view.content == "Sure." and [c.name for c in view.calls] == ["add", "get_weather"] and args(view) == {"a": 1}
    assert len(both(ReplyParser(bracketed, TOOLS, parallel_tool_calls=False), block).calls) == 1
    thinking = both(parser, "<think>call it" + block)  # the block ends reasoning left open at the reply's end
    assert thinking.reasoning == "call it" and len(thinking.calls) == 2
    other = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'  # another family's markup is content here
    assert both(parser, other).content == other
    cut = '[CALLS][{"name": "add", "arguments": {"a": 2}}'
    assert args(both(parser, cut)) == {"a": 2} and both(parser, cut, end_token=False).content == cut
    broken = "[CALLS]not json[/CALLS]"
    assert both(parser, broken).content == broken


def test_the_forced_grammar_takes_the_family_calls_only(bracketed: ReplyFormat) -> None:
    bundle = load_tokenizer(BUILTIN_TINY_GLM)
    backend = GrammarBackend(bundle, bundle.tokenizer.get_vocab_size(), bundle.eos_token_ids)

    def matches(text: str, parallel: bool = True) -> bool:
        source = forced_call_ebnf(TOOLS, bracketed.tool_format, parallel=parallel)
        matcher = xgr.GrammarMatcher(backend.compile(GrammarSpec("ebnf", source, param="tool_choice")))
        return matcher.accept_string(text) and matcher.is_completed()

    one = '[CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}][/CALLS]'
    assert matches(one) and matches(one + "\n" + one) and not matches(one + one, parallel=False)
    assert not matches('[CALLS][{"name": "sub", "arguments": {}}][/CALLS]')  # not an offered tool
    assert not matches('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
