"""Forced-call grammars bound blanks as JSON grammars do, for each call markup (Hermes JSON, GLM, Qwen XML).

The grammar is compiled the way the engine compiles it (GrammarBackend, tiny-glm's tokenizer) and driven
with xgrammar's GrammarMatcher directly: 32 blank characters between two calls, or between two JSON tokens
inside a call, are accepted; 33 are refused; the markup's own line breaks are single optional newlines;
and ordinary calls, alone or several in a row, still complete. The gap a grammar leaves after the think
closer (where a template writes "\n\n") holds at most 32 blank characters too, however wide a tokenizer's
blank tokens are.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import xgrammar as xgr

from deployments.chat_format.forced_calls import MAX_BLANKS, forced_call_ebnf
from deployments.chat_format.markups import GLM, HERMES, QWEN_XML
from deployments.messages.requests import GrammarSpec
from deployments.model_rank.sampler import unpack_bitmask
from deployments.scheduler.engine.grammar import MAX_BLANKS_AFTER_THINK, MAX_JSON_BLANKS, GrammarBackend
from deployments.tokenizer import load_tokenizer
from serve_app.fixtures.tokenizer_builder import build_tokenizer
from tests.conftest import BUILTIN_TINY_GLM

WHERE = {"type": "object", "properties": {"lat": {"type": "integer"}}, "required": ["lat"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {"type": "object", "properties": {"where": WHERE}, "required": ["where"]},
        },
    },
]


def _hermes(gap: str) -> str:
    """One Hermes call with `gap` between two JSON tokens (after the name's colon)."""
    return f'<tool_call>\n{{"name":{gap}"plan", "arguments": {{"where": {{"lat": 1}}}}}}\n</tool_call>'


def _glm(gap: str) -> str:
    """One GLM call with `gap` inside its JSON argument value."""
    return f'<tool_call>plan\n<arg_key>where</arg_key>\n<arg_value>{{"lat":{gap}1}}</arg_value>\n</tool_call>'


def _qwen_xml(gap: str) -> str:
    """One Qwen XML call with `gap` inside its JSON parameter value."""
    return f'<tool_call>\n<function=plan>\n<parameter=where>\n{{"lat":{gap}1}}\n</parameter>\n</function>\n</tool_call>'


CALLS: dict[str, Callable[[str], str]] = {HERMES: _hermes, GLM: _glm, QWEN_XML: _qwen_xml}
SECOND = {  # another ordinary call to the other tool, in each markup
    HERMES: '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    GLM: "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n"
    "<arg_key>b</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    QWEN_XML: "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
    "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    bundle = load_tokenizer(BUILTIN_TINY_GLM)
    return GrammarBackend(bundle, bundle.tokenizer.get_vocab_size(), bundle.eos_token_ids)


def _matches(backend: GrammarBackend, markup: str, text: str, parallel: bool = True) -> bool:
    """Whether the forced-call grammar takes `text` whole and may end right after it."""
    source = forced_call_ebnf(TOOLS, markup, parallel=parallel)
    matcher = xgr.GrammarMatcher(backend.compile(GrammarSpec("ebnf", source, param="tool_choice")))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("markup", sorted(CALLS))
def test_ordinary_calls_still_complete(backend: GrammarBackend, markup: str) -> None:
    call = CALLS[markup]
    assert _matches(backend, markup, call(""))
    assert _matches(backend, markup, call(" "))
    assert _matches(backend, markup, SECOND[markup])
    assert _matches(backend, markup, call("") + SECOND[markup])
    assert _matches(backend, markup, call("") + "\n\n" + SECOND[markup] + "\n" + call(""))
    assert not _matches(backend, markup, call("") + "\nSure, here it is.\n" + SECOND[markup])  # prose may not
    assert not _matches(backend, markup, call("") + SECOND[markup], parallel=False)  # exactly one call


@pytest.mark.parametrize("markup", sorted(CALLS))
@pytest.mark.parametrize("blank", [" ", "\n", " \n"])
def test_blanks_between_calls_stop_at_the_json_bound(backend: GrammarBackend, markup: str, blank: str) -> None:
    call, second = CALLS[markup](""), SECOND[markup]
    fits = (blank * MAX_BLANKS)[:MAX_BLANKS]
    assert MAX_BLANKS == 32 and len(fits) == 32
    assert _matches(backend, markup, call + fits + second)
    assert not _matches(backend, markup, call + fits + blank[0] + second)
    assert not _matches(backend, markup, call + blank * 300 + second)


@pytest.mark.parametrize("markup", sorted(CALLS))
@pytest.mark.parametrize("blank", [" ", "\n", "\t", "\r\n"])
def test_blanks_inside_a_call_stop_at_the_json_bound(backend: GrammarBackend, markup: str, blank: str) -> None:
    call = CALLS[markup]
    fits = (blank * MAX_BLANKS)[:MAX_BLANKS]
    assert _matches(backend, markup, call(fits))
    assert not _matches(backend, markup, call(fits + blank[0]))
    assert not _matches(backend, markup, call(blank * 300))


def test_glm_markup_line_breaks_are_single_newlines(backend: GrammarBackend) -> None:
    tight = '<tool_call>plan<arg_key>where</arg_key><arg_value>{"lat":1}</arg_value></tool_call>'
    assert _matches(backend, GLM, tight)
    assert _matches(backend, GLM, _glm(""))  # the template's own newlines
    for doubled in ("plan\n\n<arg_key>", "</arg_key>\n\n<arg_value>", "</arg_value>\n\n</tool_call>"):
        single = doubled.replace("\n\n", "\n")
        assert not _matches(backend, GLM, _glm("").replace(single, doubled)), doubled


def test_blanks_after_the_think_closer_are_bounded_in_characters(tmp_path: Path) -> None:
    corpus = [f"step {i}:" + " " * 24 + "done\n" for i in range(40)]  # teaches the tokenizer wide blank tokens
    bundle = load_tokenizer(build_tokenizer(tmp_path, vocab_size=512, family="glm", corpus=corpus))
    backend = GrammarBackend(bundle, bundle.tokenizer.get_vocab_size(), bundle.eos_token_ids)
    widths = backend.blank_widths()
    wide = max(widths, key=lambda token: widths[token])
    assert widths[wide] * MAX_BLANKS_AFTER_THINK > MAX_JSON_BLANKS, widths  # tokens alone would let 33+ through
    closer = bundle.tokenizer.token_to_id("</think>")
    grammar = backend.reply_grammar(GrammarSpec("regex", "ab", think_closer_id=closer, starts_in_think=True))
    grammar.accept(closer)
    written = 0
    while bool(unpack_bitmask(grammar.allowed(), backend.vocab_size)[wide]):
        grammar.accept(wide)
        written += widths[wide]
    assert written <= MAX_JSON_BLANKS < written + widths[wide]
    assert grammar.blanks_after_think < MAX_BLANKS_AFTER_THINK  # the characters ended the gap, not the count
    narrow = [t for t, w in widths.items() if written + w <= MAX_JSON_BLANKS]
    allowed = unpack_bitmask(grammar.allowed(), backend.vocab_size)
    assert all(bool(allowed[t]) for t in narrow) and bool(allowed[bundle.tokenizer.token_to_id("a")])
