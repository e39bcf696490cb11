"""Gemma 4's chat format: its argument syntax, its turn end after calls, its thought channel and its grammar.

The oracle is Gemma 4's own template: arguments it writes into an earlier turn read back as the same JSON,
whole and streamed; the forced-call grammar takes what it writes and refuses what it never writes. Over HTTP
(a random Gemma 4 checkpoint with the Gemma vocabulary and template, its generation prompt opening the
channel) a thinking budget closes the channel with the template's `\\n<channel|>`, the chat, Messages and
Responses routes report the same reasoning and answer, and a response_format grammar holds only after the channel.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr
from fastapi.testclient import TestClient

from deployments.chat_format.forced_calls import forced_call_ebnf
from deployments.chat_format.markups import GEMMA
from deployments.chat_format.reply_parser import ReplyParser
from deployments.chat_format.think import CHANNEL
from deployments.messages.render import ReplyFormat
from deployments.messages.requests import GrammarSpec
from deployments.scheduler.engine.grammar import GrammarBackend
from deployments.tokenizer import load_tokenizer
from tests.chat_format.test_reply_parser import both
from tests.chat_format.test_template_replies import VENDOR_TEMPLATES, renderer_for, shown_reply, tool_call
from tests.conftest import BUILTIN_TINY_GLM

GEMMA_TEMPLATE = VENDOR_TEMPLATES / "google-gemma-4-31B-it.jinja"
FREE = {"type": "function", "function": {"name": "save", "parameters": {"type": "object", "properties": {}}}}
REPLY = ReplyFormat(tool_format=GEMMA, think_format=CHANNEL.name)
ARGUMENTS = [  # what a call may carry: every JSON type, nested, and strings holding Gemma's own punctuation
    {"n": -3, "x": 2.5e-05, "big": 12345678901, "ok": False, "none": None},
    {"text": "a, b: {c} [d]", "empty": "", "quote": 'say "hi"', "line": "one\ntwo"},
    {"rows": [{"id": 1, "tags": ["a", "b"]}, {"id": 2, "tags": []}], "grid": [[1, 2], [3]], "blank": {}},
    {"Key-With.dots_and-dashes": "v", "unicode": "ünï 日本"},
]


@pytest.fixture(scope="module")
def gemma_source() -> str:
    if not GEMMA_TEMPLATE.exists():
        pytest.skip(f"{GEMMA_TEMPLATE} is not beside this checkout (vendor templates live in ../shared)")
    return GEMMA_TEMPLATE.read_text(encoding="utf-8")


@pytest.mark.parametrize("arguments", ARGUMENTS, ids=range(len(ARGUMENTS)))
def test_arguments_the_template_writes_read_back_as_the_same_json(
    gemma_source: str, chatml_tokenizer_dir: Path, arguments: dict
) -> None:
    renderer = renderer_for(gemma_source, chatml_tokenizer_dir)
    turn = {"role": "assistant", "content": "", "tool_calls": [tool_call("save", arguments)]}
    text, reply = shown_reply(renderer, [FREE], turn, {})
    assert text.startswith("<|tool_call>call:save{") and text.endswith("<tool_call|>"), text
    view = both(ReplyParser(reply, [FREE]), text)
    assert [(c.name, json.loads(c.arguments)) for c in view.calls] == [("save", arguments)]


@pytest.mark.parametrize(
    "body",
    [
        'call:save{a:<|"|>open}',  # an unclosed string
        "call:save{a:1",  # an unclosed object
        "save{a:1}",  # no `call:`
        "call:save{a:1}b",  # text after the arguments
        "call:save{:1}",  # a missing key
        "call:save{a:}",  # a missing value
        "call:sa ve{}",  # not a function name
    ],
)
def test_a_block_that_is_not_a_call_stays_content(body: str) -> None:
    text = f"Before <|tool_call>{body}<tool_call|>"
    view = both(ReplyParser(REPLY, [FREE]), text)
    assert view.calls == [] and view.content == text


def test_a_bare_word_reads_as_a_string_and_keys_may_be_quoted() -> None:
    text = '<|tool_call>call:save{city:Oslo,<|"|>k<|"|>:[x,2]}<tool_call|>'
    view = both(ReplyParser(REPLY, [FREE]), text)
    assert json.loads(view.calls[0].arguments) == {"city": "Oslo", "k": ["x", 2]}


def test_the_turn_end_after_calls_ends_the_reply() -> None:
    text = '<|tool_call>call:save{}<tool_call|><|tool_response>response:save{value:<|"|>made up<|"|>}'
    view = both(ReplyParser(REPLY, [FREE]), text, end_token=False)
    assert (view.content, [c.name for c in view.calls]) == ("", ["save"])


def test_the_thought_channel_is_reasoning_without_its_label() -> None:
    text = "<|channel>thought\nStep one, then two.\n<channel|>The answer."
    view = both(ReplyParser(REPLY), text)
    assert (view.reasoning, view.content) == ("Step one, then two.", "The answer.")
    # A channel the template opened: the label was the prompt's, the block starts with the reasoning.
    opened = both(ReplyParser(ReplyFormat(think_format=CHANNEL.name, prompt_opens_thinking=True)), "thin\n<channel|>ok")
    assert (opened.reasoning, opened.content) == ("thin", "ok")


# ---- the forced-call grammar --------------------------------------------------------------------------------
PLAN = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "type": "object",
            "properties": {
                "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}}},
                "days": {"type": "array", "items": {"enum": ["mon", "tue"]}, "minItems": 1, "maxItems": 2},
                "city": {"type": "string", "maxLength": 8},
                "fast": {"type": "boolean"},
                "note": {"type": "null"},
            },
            "required": ["days", "where"],
        },
    },
}


@pytest.fixture(scope="module")
def gemma_grammar() -> xgr.Grammar:
    bundle = load_tokenizer(BUILTIN_TINY_GLM)
    backend = GrammarBackend(bundle, bundle.tokenizer.get_vocab_size(), bundle.eos_token_ids)
    return backend.compile(GrammarSpec("ebnf", forced_call_ebnf([PLAN], GEMMA, parallel=False), param="tool_choice"))


def _takes(grammar: Any, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def test_the_grammar_takes_the_calls_the_template_writes(
    gemma_source: str, chatml_tokenizer_dir: Path, gemma_grammar: Any
) -> None:
    renderer = renderer_for(gemma_source, chatml_tokenizer_dir)
    for arguments in (
        {"days": ["mon"], "where": {"lat": -7}},
        {"city": "Oslo", "days": ["tue", "mon"], "fast": True, "note": None, "where": {}},
    ):
        turn = {"role": "assistant", "content": "", "tool_calls": [tool_call("plan", arguments)]}
        text, _ = shown_reply(renderer, [PLAN], turn, {})
        assert _takes(gemma_grammar, text) and _takes(gemma_grammar, text + "<|tool_response>"), text


@pytest.mark.parametrize(
    "arguments",
    [
        'where:{},days:[<|"|>mon<|"|>]',  # keys out of the template's sorted order
        'days:[<|"|>mon<|"|>]',  # a required key missing
        "days:[],where:{}",  # fewer items than minItems
        'days:[<|"|>mon<|"|>,<|"|>mon<|"|>,<|"|>tue<|"|>],where:{}',  # more than maxItems
        'days:[<|"|>wed<|"|>],where:{}',  # outside the enum
        'days:[<|"|>mon<|"|>],where:{lat:91}',  # above the maximum
        'city:<|"|>Amsterdam<|"|>,days:[<|"|>mon<|"|>],where:{}',  # longer than maxLength
        'days: [<|"|>mon<|"|>],where:{}',  # a blank the template never writes
    ],
)
def test_the_grammar_refuses_what_the_schema_or_template_rules_out(gemma_grammar: Any, arguments: str) -> None:
    assert not _takes(gemma_grammar, "<|tool_call>call:plan{" + arguments + "}<tool_call|>")


# ---- over HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(gemma_source: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer, use_tokenizer_end_token
    from tests.support.local_app import local_client

    model = tmp_path_factory.mktemp("gemma-format")
    build_tokenizer(model, vocab_size=512, family="gemma")
    build_random_checkpoint("gemma4_text", model, vocab_size=512, seed=3, max_position_embeddings=2048)
    # The generation prompt opens the channel itself (the model then starts inside it), so the budget applies.
    opening = gemma_source.replace(
        "{{- '<|turn>model\\n' -}}",
        "{{- '<|turn>model\\n' -}}{%- if enable_thinking -%}<|channel>thought\n{%- endif -%}",
    )
    assert opening != gemma_source
    (model / "chat_template.jinja").write_text(opening, encoding="utf-8")
    use_tokenizer_end_token(model)
    with local_client(str(model), window=1024, parallel=4) as test_client:
        yield test_client


def test_a_thinking_budget_closes_the_channel_and_every_route_reads_it_alike(client: TestClient) -> None:
    user = [{"role": "user", "content": "Plan it."}]
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": user,
            "max_tokens": 12,
            "temperature": 0,
            "thinking_budget": 5,
            "chat_template_kwargs": {"enable_thinking": True},
            "return_token_ids": True,
        },
    ).json()
    choice = chat["choices"][0]
    written = client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert "\n<channel|>" in written, written
    reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
    assert reasoning and reasoning == written.split("\n<channel|>")[0].strip(), written
    messages = client.post(
        "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 12,
            "temperature": 0,
            "messages": user,
            "thinking": {"type": "enabled", "budget_tokens": 5},
        },
    ).json()
    blocks = [(b["type"], b.get("thinking", b.get("text"))) for b in messages["content"]]
    assert blocks[0] == ("thinking", reasoning) and (not content or blocks[1] == ("text", content)), blocks
    responses = client.post(
        "/v1/responses",
        json={"model": "tiny", "input": "Plan it.", "max_output_tokens": 12, "temperature": 0}
        | {"reasoning": {"effort": "low"}, "thinking_budget": 5},
    ).json()
    items = {item["type"]: "".join(part["text"] for part in item["content"]) for item in responses["output"]}
    assert items["reasoning"] == reasoning and items.get("message", "") == content, items


@pytest.mark.parametrize(("effort", "thinking"), [("none", False), ("minimal", True), ("high", True)])
def test_reasoning_effort_switches_the_channel(
    gemma_source: str, chatml_tokenizer_dir: Path, effort: str, thinking: bool
) -> None:
    from deployments.messages.render import ChatRenderRequest

    renderer = renderer_for(gemma_source, chatml_tokenizer_dir)
    request = ChatRenderRequest([{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    text, _ = renderer.render_text(request)
    reply = renderer.render_chat(request).reply
    # The template names no levels: any effort but none turns thinking on (`<|think|>`), none closes the channel.
    assert ("<|think|>" in text, reply.prompt_closes_thinking, reply.enable_thinking) == (
        thinking,
        not thinking,
        thinking,
    )


def test_a_grammar_starts_after_the_channel_closes(client: TestClient) -> None:
    """With thinking on, response_format constrains only what follows `<channel|>`: the budget closes the
    channel, then the answer is JSON under the schema while the reasoning before it was free."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {"type": "object", "properties": {"n": digit}, "required": ["n"], "additionalProperties": False}
    body = {
        "messages": [{"role": "user", "content": "A number, as JSON."}],
        "max_tokens": 200,  # room for the JSON's gaps at their bound of 32 blanks each: it always ends
        "temperature": 0,
        "thinking_budget": 4,
        "chat_template_kwargs": {"enable_thinking": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        "return_token_ids": True,
    }
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    written = client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert "\n<channel|>" in written and choice["message"]["reasoning_content"], written
    assert choice["finish_reason"] == "stop", written
    assert json.loads(choice["message"]["content"])["n"] in range(10), written
